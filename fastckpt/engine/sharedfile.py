"""One torch checkpoint file written by several data-parallel ranks (``Checkpointer.save_file`` with
``distributed=True``).

Every rank plans the same file (``torch.save`` under ``skip_data``), but the pickled bytes around the records may
differ between ranks (a callback's timer, a rank's own metric), and with them every record's offset. So rank 0's
layout is the truth: each rank writes its records where rank 0's file puts them. The protocol runs on the
committer threads, over the Coordinator's private gloo group, once per save and in save order:

1. rank 0 sends its layout (each record's size, storage type and writing rank, and its offset), or word that it
   failed before the commit;
2. every rank checks that its own records match (same sizes, types and writers, in the same order: the same
   storages, split the same way), then writes its records at rank 0's offsets into one temporary file next to the
   target, every rank opening it without truncating, and syncs it;
3. every rank's CRC-32s (or its error) go to rank 0;
4. rank 0 writes the fixed bytes (pickle, zip headers, central directory) with the CRC fields filled in, syncs,
   and renames the file to its name: the commit. Any failure, on any rank, and nothing is renamed;
5. rank 0's verdict goes to every rank: each raises the same error for the same file, and the temporary file is
   removed.

A rank whose storages differ from rank 0's fails the checkpoint on every rank (``StateMismatchError``): there is
no fallback to rank 0 alone, which would need rank 0 to have staged the other ranks' records.
The ranks must see one file: one node, or a shared POSIX file system. On S3 the ranks upload the parts of
one multipart upload instead (``sharedobject.py``).
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Executor
from typing import Any, Callable

from .distributed import Coordinator
from ..errors import FastCkptError, StateMismatchError, StorageError
from ..format.health import HEALTH_ATTR, HealthPart, content_tie
from ..format.torchfile import TorchFileFormat
from ..storage.tempmark import temp_basename

__all__ = ["SharedFileWrite", "can_share", "raise_agreed", "shared_chunk", "temporary_name"]

log = logging.getLogger("fastckpt")


def can_share(storage: Any) -> bool:
    """Whether ranks can write ranges of one file in ``storage`` (a local or shared POSIX file system)."""
    return all(callable(getattr(storage, m, None)) for m in ("write_at", "sync", "publish"))


def temporary_name(path: str, uid: str) -> str:
    """The hidden temporary file next to ``path`` the ranks write into; ``uid`` is the save's, alike on every rank
    (a SIGKILLed save leaves it behind, with the marker rank 0 created: storage/tempmark.py)."""
    folder, base = os.path.split(path)
    return os.path.join(folder, temp_basename(base, uid))


class SharedFileWrite:
    """The commit protocol of one shared file on one rank (called by the committer thread)."""

    def __init__(self, coord: Coordinator, storage: Any, fmt: TorchFileFormat, uid: str, writers: list[int],
                 name: str) -> None:
        self.coord, self.storage, self.fmt, self.name = coord, storage, fmt, name
        self.tmp = temporary_name(fmt.path, uid)
        self.writers = writers  # the rank that writes each record, as this rank planned it
        self.written = 0  # bytes this rank wrote (its records; rank 0 also the fixed bytes)
        self.marked = False  # rank 0: whether it created the temporary file's marker (storage/tempmark.py)
        self.crc32c: int | None = None  # rank 0, where the protocol learns it: the whole file's CRC32C

    def run(self, views: dict[int, memoryview], crcs: dict[int, int], error: BaseException | None,
            pool: Executor | None = None, health: dict[str, Any] | None = None,
            record: Callable[[dict[str, Any], str | None], bytes] | None = None) -> int:
        """Every rank, the same collectives in the same order whatever fails; returns the file's size or raises the
        verdict (``StorageError``, the same text on every rank). ``health``: this rank's tensor statistics, which
        travel to rank 0; there ``record(all of them, the file's content_tie)`` is the file's health record (its
        extended attribute)."""
        coord = self.coord
        layout = self.fmt.layout
        mine = (self.fmt.signature(), self.writers, [r.offset for r in layout.records])
        if coord.rank == 0 and error is None:
            try:  # before any rank writes a byte: the file new, and its marker, gc's proof that fastckpt wrote it
                self.storage.mark_temp(self.tmp, create_temp=True)
                self.marked = True
            except FastCkptError as e:
                error = e
        try:
            ref = self._collective(coord.share, mine if error is None else None)  # 1.
        except FastCkptError:
            self._remove_tmp()
            raise
        local = error
        sent: dict[int, int] = {}
        if local is None and ref is not None:
            try:
                self._check(ref, mine)  # 2.
                self._write(ref[2], views, pool)
                sent = {i: crcs[i] for i in views}
            except BaseException as e:  # noqa: BLE001 - reported to rank 0 below, so no rank hangs
                local = e
        try:
            parts = [sent] + ([HealthPart(health)] if health is not None else [])
            merged, failed = self._collective(coord.gather, parts, local)  # 3.
            if coord.rank == 0:
                if failed is None and ref is None:
                    failed = f"rank 0: {error}"
                if failed is None:
                    failed = self._commit(merged, record)  # 4.
            verdict = self._collective(coord.outcome, failed)  # 5.
        except FastCkptError:
            self._remove_tmp()
            raise
        if verdict is not None:
            self._remove_tmp()
            raise_agreed(self.name, self.fmt.path, verdict, local)
        return layout.size

    def _collective(self, fn: Any, *args: Any) -> Any:
        """A collective of the protocol; one that fails (a rank died) ends the protocol on this rank."""
        try:
            return fn(*args)
        except Exception as e:
            err = StorageError(f"checkpoint {self.name!r} at {self.fmt.path} failed: the ranks sharing its writes "
                               f"lost each other (a rank died?): {e}")
            err._fastckpt_agreed = True  # type: ignore[attr-defined]
            raise err from e

    def _check(self, ref: tuple[Any, list[int], list[int]], mine: tuple[Any, list[int], list[int]]) -> None:
        """Raise ``StateMismatchError`` naming the first record where this rank's file differs from rank 0's."""
        (sig0, writers0, _), (sig, writers, _) = ref, mine
        if sig == sig0 and writers == writers0:
            return
        if len(sig) != len(sig0):
            what = f"{len(sig)} storages, rank 0 has {len(sig0)}"
        else:
            i = next(i for i in range(len(sig)) if sig[i] != sig0[i] or writers[i] != writers0[i])
            what = (f"record data/{i}: {sig[i][0]} bytes of {sig[i][1]} written by rank {writers[i]}, rank 0 has "
                    f"{sig0[i][0]} bytes of {sig0[i][1]} written by rank {writers0[i]}")
        raise StateMismatchError(
            f"rank {self.coord.rank} cannot share the writes of {self.fmt.path!r}: its checkpoint's storages differ "
            f"from rank 0's ({what}). Every rank must save the same structure, with the same optimizers watched")

    def _write(self, offsets: list[int], views: dict[int, memoryview], pool: Executor | None) -> None:
        """Write this rank's records at rank 0's offsets (in parallel, by record), then sync the file."""
        pieces = [(offsets[i], views[i]) for i in sorted(views) if len(views[i])]
        if pool is not None and len(pieces) > 1:
            for f in [pool.submit(self.storage.write_at, self.tmp, [p]) for p in pieces]:
                f.result()
        else:
            self.storage.write_at(self.tmp, pieces)
        if pieces and self.coord.rank != 0:  # rank 0 syncs once, at its commit: one fsync covers the whole file
            self.storage.sync(self.tmp)  # here: rank 0's commit must find this rank's bytes durable (a shared FS)
        self.written += sum(len(v) for _, v in pieces)

    def _commit(self, merged: list[Any],
                record: Callable[[dict[str, Any], str | None], bytes] | None = None) -> str | None:
        """Rank 0, every rank's records written: the fixed bytes, the health record, sync, rename. The error text,
        or None."""
        crcs: dict[int, int] = {}
        tensors: dict[str, Any] = {}
        for part in merged:
            if isinstance(part, HealthPart):
                tensors.update(part.tensors)
            else:
                crcs.update(part)
        missing = [i for i, r in enumerate(self.fmt.layout.records) if r.nbytes and i not in crcs]
        if missing:
            return f"rank 0 commit: no rank wrote record data/{missing[0]} ({len(missing)} missing)"
        try:
            fixed = [(off, memoryview(b)) for off, b in self.fmt.fixed(crcs) if len(b)]
            self.storage.write_at(self.tmp, fixed)
            self.written += sum(len(b) for _, b in fixed)
            set_attrs = getattr(self.storage, "set_attrs", None)  # local storage only; refused: health unknown
            if record is not None and set_attrs is not None:  # before the rename: never named without it
                set_attrs(self.tmp, {HEALTH_ATTR: record(tensors, content_tie(self.fmt, crcs))})
            self.storage.sync(self.tmp)
            self.storage.publish(self.tmp, self.fmt.path)  # <- the commit point
        except BaseException as e:  # noqa: BLE001 - broadcast as the verdict
            return f"rank 0 commit: {e}"
        self._unmark()
        return None

    def _unmark(self) -> None:
        if self.marked:
            self.marked = False
            self.storage.unmark_temp(self.tmp)

    def _remove_tmp(self) -> None:
        """Every rank, on failure: no rank renames after a failed verdict, so the file is garbage."""
        try:
            self.storage.delete(self.tmp)
        except Exception as e:  # noqa: BLE001 - the storage may be what failed
            log.warning("fastckpt: could not remove the temporary file %s: %s", self.tmp, e)
            return  # its marker stays: gc removes both once they are old
        self._unmark()


def raise_agreed(name: str, path: str, verdict: str, local: BaseException | None) -> None:
    """Raise rank 0's verdict on a shared write, the same error on every rank (marked agreed: the ranks need not
    tell each other again), chained from this rank's own failure if it had one."""
    err = StorageError(f"checkpoint {name!r} at {path} failed: {verdict}")
    err._fastckpt_agreed = True  # type: ignore[attr-defined]
    if local is not None:
        raise err from local
    raise err


def shared_chunk(chunk_bytes: int, sizes: list[int], world: int) -> int:
    """The shard size of a torch file shared by ``world`` ranks: about four shards per rank, so that the balance by
    bytes (in whole shards) evens out, and never above ``persist.chunk_bytes``. A function of the structure only, so
    every rank plans alike and the plan stays cached."""
    return max(4096, min(chunk_bytes, sum(sizes) // (4 * world)))
