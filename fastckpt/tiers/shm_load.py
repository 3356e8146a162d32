"""Loading a committed checkpoint from the shared-memory tier, without reading its shards from disk.

When a snapshot staged in ``/dev/shm`` commits, its record becomes ``committed.json`` and the
buffers stay as they are until the slot is taken for the next snapshot. A process restarted on the
same machine after a crash finds them (``ShmTier.committed``): if the committed checkpoint it is
about to load has the same name, step and uid, and every tensor's dtype, shape and CRC32C in the
record match the manifest's table, the tensor bytes are copied out of shared memory instead of read
from disk. The copies go through ``fastckpt.read.readers`` like any other load, so every tensor's CRC32C
is checked on the copy against the manifest's. The manifest and meta files (a few KiB) are still
read from the root: they say what is committed.

Any mismatch or failure falls back to the disk (or remote) copy, with a log line saying why.

The copies are ``pread``s of the staged buffer files (tmpfs), 1 MiB at a time, each step's CRC32C taken
right after it (``readers.COPY_STEP``): the CRC reads the copy from the CPU cache instead of memory. No
mapping: copying out of a fresh mapping of the buffers faults its page tables in 64 KiB at a time and tears
them down afterwards. Measured on the 2-core VM (1.48 GB, a crashed process's snapshot, a fresh process per
load): ``load_into()`` 0.16 s (0.16-0.21) against 0.29 s through a mapping (0.23 s copying, ~45 ms unmapping),
beside 0.10-0.16 s for torch's copy (no checksum) out of a fresh mapping into faulted-in memory; ``load()``
0.35-0.37 s against 0.55-1.59 s for torch's copy into fresh memory (the first touch of fresh memory varies
that much here).
"""
from __future__ import annotations

import bisect
import copy
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from ..errors import FastCkptError, IntegrityError
from ..read.load_into import read_into
from ..read.loadstats import LoadStats
from ..read.readers import pread_all
from ..format.shm_record import StagedRecord

if TYPE_CHECKING:
    from ..read.loader import CheckpointReader
    from .shm import ShmTier

__all__ = ["shm_reader", "load_from_shm"]

_WHOLE = object()  # load_from_shm's target when the whole state is rebuilt (``load()``)

log = logging.getLogger("fastckpt")


class _ShmShards:
    """A ``Storage`` stand-in for ``read_ranges``: the shard files' tensor ranges, served from shared memory.

    Everything else (sizes, small files) is the root's; only ``read_into`` of a tensor range is redirected,
    to a ``pread`` of the staged buffer file (tmpfs: a copy out of the page cache, no mapping).
    ``in_memory`` tells ``read_ranges`` to copy and checksum in small steps (the CRC reads the copy from cache).
    """

    in_memory = True

    def __init__(self, inner: Any, fds: dict[int, int], where: dict[str, list[tuple[int, int, int, int]]]):
        self._inner = inner
        self._fds = fds  # shard index -> descriptor of its staged buffer; closed by close()
        self._where = where  # per file name: sorted (disk offset, nbytes, shard index, offset in the buffer)
        self.url = inner.url

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        rows = self._where[path.rsplit("/", 1)[-1]]
        i = bisect.bisect_right(rows, (offset, float("inf"))) - 1
        start, nbytes, shard, at = rows[i]
        assert start <= offset and offset + len(out) <= start + nbytes, "a piece crosses a tensor"
        try:
            pread_all(self._fds[shard], out, at + offset - start)
        except EOFError as e:  # the buffer file shrank under us: not the snapshot that was checked
            raise IntegrityError(f"the staged buffer of {path.rsplit('/', 1)[-1]} ended early in shared memory "
                                 f"({e})") from e

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


def load_from_shm(tier: "ShmTier | None", reader: "CheckpointReader", target: Any = _WHOLE) -> tuple[Any, LoadStats] | None:
    """Called by ``Checkpointer.load``/``load_into`` (``target``) with the reader of the committed checkpoint:
    the loaded tree and its stats if shared memory holds that checkpoint, else None (read it as usual).
    A failure while copying (an altered buffer) is logged and also answers None: the caller reads the
    checkpoint from its root, which rewrites every tensor that a ``load_into`` had already filled."""
    fast = shm_reader(tier, reader) if tier is not None else None
    if fast is None:
        return None
    t0 = time.perf_counter()
    try:
        done = read_into(fast, {} if target is _WHOLE else target)
    except FastCkptError as e:
        log.warning("fastckpt: loading %s from shared memory failed (%s); reading it from %s", reader.dirpath, e,
                    reader.storage.url)
        return None
    finally:
        fast.storage.close()  # type: ignore[attr-defined]
    if done is None:
        return None
    return done[0], LoadStats(reader.name, reader.step, "shm", "shm", done[1], time.perf_counter() - t0,
                              reader.verify)


def shm_reader(tier: "ShmTier", reader: "CheckpointReader") -> "CheckpointReader | None":
    """A copy of ``reader`` whose tensor bytes come from a committed snapshot in shared memory, or None."""
    uid = reader.manifest["meta"].split(".")[1] if reader.manifest["meta"].count(".") >= 2 else None
    if reader.dtensors or reader.coord is not None or uid is None:
        return None
    for rec in tier.committed():
        if (rec.name, rec.step, rec.uid) != (reader.name, reader.step, uid) or rec.dtensors:
            continue
        try:
            where = _layout(rec, reader)
            if where is None:
                log.info("fastckpt: the snapshot of %s in shared memory does not match its manifest; reading "
                         "from %s", rec.label, reader.dirpath)
                return None
            fds = tier.buffer_files(rec)
        except FastCkptError as e:
            log.info("fastckpt: cannot use the snapshot of %s in shared memory (%s); reading from %s",
                     rec.label, e, reader.dirpath)
            return None
        rows = {name: sorted(cells) for name, cells in where.items()}
        out = copy.copy(reader)
        out.storage = _ShmShards(reader.storage, fds, rows)  # type: ignore[assignment]
        return out
    return None


def _layout(rec: StagedRecord, reader: "CheckpointReader") -> dict[str, list[tuple[int, int, int, int]]] | None:
    """Per shard file: (disk offset, nbytes, shard index, offset in its buffer) of every tensor, if the
    record describes exactly the committed table (same tensors, same checksums); else None."""
    plan = rec.plan
    if len(plan.entries) != len(reader.entries):
        return None
    staged_crc: dict[int, int] = {}
    for shard in plan.mine(plan.shards):
        for e, c in zip(shard.entries, rec.crcs[shard.index]):
            staged_crc[e.index] = c
    where: dict[str, list[tuple[int, int, int, int]]] = {}
    for e, p in zip(reader.entries, plan.entries):
        if (e.index, e.dtype, e.shape, e.nbytes) != (p.index, p.dtype, p.shape, p.nbytes):
            return None
        if e.nbytes == 0:
            continue
        if staged_crc.get(p.index) != e.crc:
            return None
        where.setdefault(e.file, []).append((e.offset, e.nbytes, p.shard, p.offset))
    return where
