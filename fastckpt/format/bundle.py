"""Several framework files in one folder, saved by one engine job, with a ``manifest.json`` written last.

A framework such as Accelerate saves a checkpoint as a folder of files in its own formats
(``model.safetensors``, ``optimizer.bin``, ...). ``FileBundle`` treats the folder like one save: each member
file is a format (``SafetensorsFileFormat`` or ``TorchFileFormat``) that decides its header/skeleton and where
its tensors go; the engine stages every member's tensors into one host slot and the committer writes:

0. each torch member with a ``PickleLoader`` (``loaders``): its pickle is unpickled as that loader will read it
   (``fastckpt.format.picklecheck``); a refusal fails the save, naming the file and the key paths at fault;
1. ``.fastckpt-pending`` (a marker: "fastckpt is writing this folder"), and removes an older ``manifest.json``;
2. each member file atomically (temporary name, then rename), computing its CRC32C while writing;
3. ``manifest.json`` (``"layout": "files"``: every member's size and CRC32C): the commit point;
4. removes the marker.

A crash anywhere before 3 leaves the marker and no manifest: fastckpt never takes the folder as committed.
"""
from __future__ import annotations

import bisect
import functools
import json
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from .checksum import crc32c
from ..errors import StorageError, UnsafeCheckpointError
from .layout import FORMAT, LAYOUT_FILES, MANIFEST, CheckpointInfo, FileRecord
from .paths import plain_name
from .picklecheck import PickleLoader, check_loads, culprits, pickle_of
from .safetensorsfile import SafetensorsFileFormat
from ..storage.protocol import Storage
from .torchfile import TorchFileFormat, plan_torch_file

__all__ = ["FileBundle", "PENDING", "SAFETENSORS", "TORCH"]

PENDING = ".fastckpt-pending"
SAFETENSORS, TORCH = "safetensors", "torch"
Member = Union[SafetensorsFileFormat, TorchFileFormat]


@dataclass(eq=False)
class FileBundle:
    """How the pipeline writes one folder of files: table entries ``starts[k]..`` belong to member ``k``."""

    dirpath: str
    name: str
    step: int
    names: list[str]
    members: list[Member]
    starts: list[int]  # first table index of each member
    user: dict[str, Any]
    made: bool = False  # the caller created the folder: if it vanishes (the user removed it) the save fails
    # torch member name -> (the loader that will read it, the object saved): checked by the committer, before
    # anything is written. The object is only walked again when its loader refuses the file, to name the keys.
    checks: dict[str, tuple[PickleLoader, Any]] = field(default_factory=dict)
    catalogued = True  # a checkpoint of the root like save()'s: listed, retained and uploaded by its manifest
    keeps_shards = True  # the member files are written at the commit, from the slot

    @classmethod
    def plan(cls, files: dict[str, tuple[str, Any]], dirpath: str, name: str, step: int, storage: Storage,
             user: dict[str, Any] | None = None, made: bool = False,
             loaders: dict[str, PickleLoader] | None = None,
             ) -> tuple["FileBundle", list[torch.Tensor], list[str], list[Any]]:
        """``files``: file name -> (``SAFETENSORS`` with a dict of tensors | ``TORCH`` with any object);
        ``loaders``: torch file name -> the loader that will read it (checked before the commit). Returns the
        bundle, the tensors to stage, their keys and the tensors whose versions the guard watches."""
        members: list[Member] = []
        tensors: list[torch.Tensor] = []
        keys: list[str] = []
        sources: list[Any] = []
        starts: list[int] = []
        for fname, (kind, obj) in files.items():
            plain_name(fname, "bundle file", dirpath)
            path = storage.join(dirpath, fname)
            starts.append(len(tensors))
            if kind == SAFETENSORS:
                fmt, ts, ks = SafetensorsFileFormat.plan(obj, path, metadata={"format": "pt"})
                members.append(fmt)
                tensors += ts
                sources += ts
                keys += [f"{fname}/{k}" for k in ks]
            else:
                tfmt, ts, ks, srcs = TorchFileFormat.plan(obj, path)
                members.append(tfmt)
                tensors += ts
                sources += srcs
                keys += [f"{fname}/{k}" for k in ks]
        checks = {n: (loader, files[n][1]) for n, loader in (loaders or {}).items()
                  if n in files and files[n][0] == TORCH}
        bundle = cls(dirpath, name, step, list(files), members, starts, dict(user or {}), made, checks)
        return bundle, tensors, keys, sources

    @property
    def size(self) -> int:
        return sum(_size(m) for m in self.members)

    def _member_of(self, index: int) -> int:
        return bisect.bisect_right(self.starts, index) - 1

    def checksum(self, data: memoryview, entries: Any) -> dict[int, int]:
        """Called by an I/O worker: each record's CRC-32 that its torch file's zip fields need (0 otherwise)."""
        out: dict[int, int] = {}
        for e in entries:
            k = self._member_of(e.index)
            local = _Shifted(e, self.starts[k])
            out.update({e.index: c for c in self.members[k].checksum(data, [local]).values()})
        return out

    def write_shard(self, storage: Storage, snap: Any, shard: Any, data: memoryview) -> tuple[int, FileRecord, list[int]]:
        """``FileFormat``: called by an I/O worker once a shard is staged; checksums it (the commit writes it)."""
        crcs = self.checksum(data, shard.entries)
        return shard.index, FileRecord("", 0, 0), [crcs[e.index] for e in shard.entries]

    def commit(self, storage: Storage, snap: Any, results: Any, staged: Any,
               pool: Executor | None = None) -> tuple[CheckpointInfo, int]:
        """``FileFormat``: called by the committer; writes the member files and then the manifest (the commit)."""
        self.check_pickles(storage)
        views, crcs = staged()
        size = self.write(storage, views, crcs, pool)
        return CheckpointInfo(snap.name, snap.step, self.dirpath, size), size

    def check_pickles(self, storage: Storage) -> None:
        """Each torch member with a loader, unpickled as that loader will read it (storages on the meta device);
        ``UnsafeCheckpointError`` naming the file, what its loader refused, the key paths at fault and the fix.
        Run by the committer before anything of the folder is written: a save that could not be loaded never
        commits, and the error is logged then and raised by the next save or ``wait()``."""
        for k, fname in enumerate(self.names):
            if fname not in self.checks:
                continue
            loader, obj = self.checks[fname]
            member = self.members[k]
            assert isinstance(member, TorchFileFormat)
            try:
                check_loads(pickle_of(member.layout), loader)
            except Exception as e:  # the unpickler raises UnpicklingError, RuntimeError, TypeError, ...
                bad = culprits(obj, loader, lambda value: pickle_of(plan_torch_file(value)))
                where = f" the values at fault: {', '.join(bad)};" if bad else ""
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise UnsafeCheckpointError(
                    f"{storage.join(self.dirpath, fname)}: {loader.reader} would refuse to load this file ({reason});"
                    f"{where} {loader.fix}. Nothing of this checkpoint was committed") from e

    def discard(self, storage: Storage, snap: Any) -> None:
        """``FileFormat``: nothing to remove: each member appears by rename, and the pending marker stays so that
        the folder is never taken as committed."""

    def write(self, storage: Storage, views: dict[int, memoryview], crcs: dict[int, int],
              pool: Executor | None = None) -> int:
        """Write every member (in parallel on ``pool``, the idle I/O workers), then the manifest: the commit point.
        Returns the bytes written."""
        self._check_folder(storage)
        storage.write_atomic(storage.join(self.dirpath, PENDING), b"fastckpt is writing this folder\n")
        storage.delete(storage.join(self.dirpath, MANIFEST))  # an older save of this folder is being replaced
        write = functools.partial(self._write_member, storage, views, crcs)
        indices = range(len(self.members))
        records = list(pool.map(write, indices) if pool is not None else map(write, indices))
        storage.write_atomic(storage.join(self.dirpath, MANIFEST), self.manifest(records))  # <- the commit point
        storage.delete(storage.join(self.dirpath, PENDING))
        return sum(r.size for r in records)

    def _write_member(self, storage: Storage, views: dict[int, memoryview], crcs: dict[int, int],
                      k: int) -> FileRecord:
        start, end = self.starts[k], self.starts[k + 1] if k + 1 < len(self.starts) else None
        mine = [i for i in views if i >= start and (end is None or i < end)]
        local_crcs = {i - start: crcs[i] for i in mine if i in crcs}
        parts = self.members[k].parts({i - start: views[i] for i in mine}, local_crcs)
        crc = 0
        for p in parts:
            crc = crc32c(p, crc)
        self._check_folder(storage)
        path = storage.join(self.dirpath, self.names[k])
        storage.write_file_atomic(path, parts)
        return FileRecord(self.names[k], sum(len(p) for p in parts), crc)

    def _check_folder(self, storage: Storage) -> None:
        # Writing would recreate a folder the user deleted (a test's temporary directory, a cleanup script).
        if self.made and not storage.exists(self.dirpath):
            raise StorageError(f"{self.dirpath} was removed while its checkpoint was being written; the save "
                               "is abandoned (nothing is recreated there)")

    def manifest(self, records: list[FileRecord]) -> bytes:
        doc = {"format": FORMAT, "version": 1, "layout": LAYOUT_FILES, "name": self.name, "step": self.step,
               "created": time.time(), "nbytes": sum(r.size for r in records),
               "files": {r.name: {"size": r.size, "crc32c": r.crc32c} for r in records}, "user": self.user}
        return json.dumps(doc, indent=1).encode()


@dataclass(frozen=True)
class _Shifted:
    """A table entry seen with its member's local index (the member's formats index their own records)."""

    entry: Any
    start: int

    @property
    def index(self) -> int:
        return self.entry.index - self.start

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.entry, attr)


def _size(member: Member) -> int:
    return member.size if isinstance(member, SafetensorsFileFormat) else member.layout.size
