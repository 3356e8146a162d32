"""``load_into``: read a checkpoint straight into the target's own tensors.

Each saved tensor's byte range is read (in parallel pieces, ``fastckpt.read.readers``) directly into the
storage of the target tensor it belongs to when that tensor is a contiguous CPU tensor of the same
dtype and shape: no file buffer, no mapping, no second copy, so the peak memory above the model is
a few descriptors and threads. Its CRC32C is checked on the target's memory as the pieces arrive.

Where the target cannot take the bytes directly the range goes through a buffer of its own and is
copied: a non-contiguous CPU target (a copy), and a CUDA target (a pinned buffer and a copy on
fastckpt's own side stream of its device, ordered after the caller's current stream there:
``fastckpt.read.devicecopy``), in batches of at most 256 MiB so that the buffers stay bounded. A dtype or shape
mismatch is a ``StateMismatchError`` naming the tensor, never a silent cast. Checkpoint tensors the
target lacks (optimizer state before the first step) are read into new tensors, as ``load()`` would.
On a remote root the reader's whole-file path serves instead (one request per tensor would be slow).

The pieces are 8 MiB on at least ``fastckpt.read.readers.READS_IN_FLIGHT`` (8) threads: cold 1.48 GB into an
allocated template, one fresh process per load, page cache dropped, 5 alternating rounds on the shared
2-core VM: median 1.30 s (1.09-1.36; 0.49x of torch.load's 2.66 s median there) against 2.30 s (1.97-2.95)
with 16 MiB pieces on ``persist.workers`` (2) threads; CPU time 0.56 s against 1.25 s. Warm: 0.32 s
against 0.43 s. A second run of 5: 1.17 s (0.95-1.33; 0.97x of torch.load's 1.21 s) against 1.76 s
(1.13-2.13). Nothing is deferred: the first write afterwards takes 0.01 s.

If a checksum fails midway the target holds a mix of old and new values: the error says so, and the
caller must load again (an earlier checkpoint) before training on.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch

from ..errors import IntegrityError, StateMismatchError
from .devicecopy import DeviceCopies
from .readers import Range, read_ranges, tensor_bytes
from .strategy import trial_read
from ..storage.fsspec import FsspecStorage
from ..storage.protocol import Storage
from ..format.table import TableEntry

__all__ = ["read_into", "check_targets", "TensorFile", "TableReader"]


@runtime_checkable
class TensorFile(Protocol):
    """One tensor file of a checkpoint, checked against its manifest (``loader.ShardFile``)."""

    @property
    def path(self) -> str: ...

    @property
    def size(self) -> int: ...

    @property
    def entries(self) -> list[TableEntry]: ...


@runtime_checkable
class TableReader(Protocol):
    """What ``read_into`` needs of a checkpoint's reader (``loader.CheckpointReader`` is one): a Protocol, so that
    this module never imports the loader that calls it."""

    storage: Storage
    dirpath: str
    verify: bool
    workers: int
    entries: list[TableEntry]

    def read_plan(self) -> Sequence[TensorFile]:
        """Called once per load: the tensor files to read, each checked against the manifest."""

    def objects(self) -> list[Any]:
        """Called once per load: the checkpoint's non-tensor leaves."""

    def read_strategy(self, files: list[tuple[str, int]], kind: str = "fresh",
                      trial: Callable[[Sequence[str], str], str | None] | None = None) -> str:
        """Called once per load, before the reads: how to read ``files`` into destinations of ``kind``."""

    def decode(self, tensors: list[Any], objects: list[Any]) -> Any:
        """Called once the tensors landed: the saved tree rebuilt around them."""


_BATCH_BYTES = 256 << 20  # buffered (CUDA, non-contiguous) tensors in flight at once: bounds the pinned memory


class _Targets:
    """Where each saved tensor lands: a ``Range`` over the target itself, or (buffered) over a buffer of its
    own that ``done`` copies into the target (a CUDA target's through ``DeviceCopies``)."""

    def __init__(self, device: DeviceCopies | None = None) -> None:
        self.ranges: list[Range] = []  # straight into the targets
        self.buffered: list[tuple[str, TableEntry, torch.Tensor, int | None]] = []
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(range) -> (buffer, target)
        # CUDA targets: one side stream per device, after the caller's; the pinned buffers held until copied.
        # The budget is a batch's: drain() runs at each batch's end, where its buffers go.
        self.device = device or DeviceCopies(budget=_BATCH_BYTES * 2)

    def add(self, path: str, e: TableEntry, dst: torch.Tensor, crc: int | None) -> None:
        if dst.device.type == "cpu" and dst.is_contiguous() and not dst.is_conj() and not dst.is_neg():
            self.ranges.append(Range(path, e.offset, tensor_bytes(dst), crc, f" in tensor {e.key!r}"))
        else:
            self.buffered.append((path, e, dst, crc))

    def prepare_cuda(self) -> None:
        """Called on the caller's thread before any copy: the side stream of each device of a CUDA target waits for
        everything already queued on the caller's current stream there (the pending lazy copies that
        ``Checkpointer.load_into`` ordered there, the kernels still reading the parameters). A stream that waits
        for nothing would overwrite the targets under them; one stream for every device would order nothing on the
        others."""
        devices = {dst.device.index for _, _, dst, _ in self.buffered if dst.is_cuda}
        if devices:
            self.device.prepare(devices)

    def batches(self) -> Iterator[list[Range]]:
        """The buffered tensors, a batch of at most ``_BATCH_BYTES`` (or one bigger tensor) at a time; a batch's
        buffers are dropped once its copies are done (pinned ones go back to torch's caching host allocator)."""
        todo = list(self.buffered)
        while todo:
            batch, size = [], 0
            while todo and (not batch or size + todo[0][1].nbytes <= _BATCH_BYTES):
                path, e, dst, crc = todo.pop(0)
                buf = torch.empty(e.shape, dtype=e.dtype, pin_memory=dst.is_cuda)
                r = Range(path, e.offset, tensor_bytes(buf), crc, f" in tensor {e.key!r}")
                self.copies[id(r)] = (buf, dst)
                batch.append(r)
                size += e.nbytes
            yield batch
            self.drain()

    def done(self, r: Range) -> None:
        """Called by the reading thread once ``r`` is verified: a buffered range is copied into its target."""
        pair = self.copies.pop(id(r), None)
        if pair is None:
            return
        buf, dst = pair
        self.device.copy(dst, buf, pinned=True)  # CUDA: on the device's side stream, no per-tensor synchronize

    def drain(self) -> None:
        """Block until every copy queued so far is done, then drop their pinned buffers (``DeviceCopies.drain``)."""
        self.device.drain()

    def finish(self) -> None:
        """Called on the caller's thread: its next kernels on each device run after the loaded values landed."""
        self.device.finish()


def read_into(reader: TableReader, target: Any) -> tuple[Any, int] | None:
    """Load ``reader``'s checkpoint into ``target``: the saved tree built on ``target``'s tensors and the
    number of tensor bytes read; None if ``target`` holds DTensors (the reader's resharding path loads those) or
    the root is remote (the reader reads whole files in concurrent ranged GETs, then copies).
    """
    from ..format.plan import flatten

    if isinstance(reader.storage, FsspecStorage):
        return None  # one request per tensor would be slow: the reader's whole-file ranged reads serve remote roots
    flat = flatten(target)
    if flat.dtensors:
        return None
    wanted = dict(zip(flat.keys, flat.tensors))
    check_targets(reader.dirpath, wanted, {e.key: (e.dtype, e.shape) for e in reader.entries})
    objects = reader.objects()
    out: list[Any] = [None] * len(reader.entries)
    targets = _Targets()
    plan = reader.read_plan()
    for f in plan:  # the same checks (listed file, size, confinement) as load()
        for e in f.entries:
            dst = wanted.get(e.key)
            if dst is None:
                dst = torch.empty(e.shape, dtype=e.dtype)  # not in the target: a new tensor, as load() makes
            out[e.index] = dst.numpy() if e.numpy else dst
            if e.nbytes:
                targets.add(f.path, e, dst, e.crc if reader.verify else None)
    for e in reader.entries:  # zero-size tensors live in no file
        if out[e.index] is None:
            t = torch.empty(e.shape, dtype=e.dtype)
            out[e.index] = t.numpy() if e.numpy else t
    paths = sorted({r.path for r in targets.ranges} | {b[0] for b in targets.buffered})
    # No WILLNEED readahead of every file first (load() and the torch zip reader have none either): with 8 reads in
    # flight the disk never idles between files, and the kernel's extra readahead competed with them. Cold 1.48 GB,
    # fresh process per load, in turns on the benchmark VM (2026-11-28): median 1.04 s without it against 1.07 s
    # with it in ``parallel`` (15 runs each), 1.04 s against 1.25 s in ``sequential`` (5 runs each).
    targets.prepare_cuda()
    tried: list[int] = []  # the bytes a trial read (the device's first big cold load_into: it chose the strategy)

    def trial(strategies: Sequence[str], default: str) -> str | None:
        verdict = trial_read(reader.storage, targets.ranges, reader.workers, targets.done, strategies, default)
        tried.append(sum(len(r.out) for r in targets.ranges))
        return verdict

    try:
        how = reader.read_strategy([(f.path, f.size) for f in plan if f.path in paths], kind="into", trial=trial)
        nbytes = tried[0] if tried else read_ranges(reader.storage, targets.ranges, reader.workers, targets.done,
                                                    strategy=how)
        for batch in targets.batches():
            nbytes += read_ranges(reader.storage, batch, reader.workers, targets.done, strategy=how)
    except IntegrityError as e:
        raise IntegrityError(f"{e}. load_into() had already written part of the target, which now mixes old "
                             "and checkpoint values: load again before training on") from e
    finally:
        targets.drain()  # a failed load too: no pinned buffer is freed while a copy may still read it
        targets.finish()
    return reader.decode(out, objects), nbytes


def check_targets(dirpath: str, wanted: dict[str, torch.Tensor],
                  saved: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Raise ``StateMismatchError`` unless every target tensor is in the checkpoint (``saved``: key -> dtype,
    shape) with the same dtype and shape: loading into a target never casts or reshapes."""
    missing = [k for k in wanted if k not in saved]
    if missing:
        raise StateMismatchError(
            f"{dirpath}: target tensor(s) {missing[:5]} are not in the checkpoint; the model/optimizer "
            "structure differs from the saved one")
    for key, t in wanted.items():
        dtype, shape = saved[key]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise StateMismatchError(
                f"{dirpath}: tensor {key!r} is {dtype} {list(shape)} in the checkpoint but "
                f"{t.dtype} {list(t.shape)} in the target; load() it and convert, or build the target to match")
