"""torch's own checkpoint format, as data: fixed bytes plus one byte range per storage.

``torch.save`` writes a zip: ``data.pkl`` (the pickle skeleton), a few small records, one
``data/<key>`` record per storage at a 64-byte aligned offset, and the central directory.
Under ``torch.serialization.skip_data()`` it writes everything except the storage bytes,
skipping over each record's data with a relative seek. ``plan_torch_file`` captures that
stream without allocating the holes and records which storage each ``data/<key>`` holds, so
the engine can treat a ``.ckpt`` exactly like a safetensors shard: a header it did not have to
compute and a list of ``(storage, offset, nbytes)`` ranges it fills from staged copies.

The writer skips the records' CRC-32 (their data descriptors say 0). ``TorchFileFormat.parts`` fills them in, in
the data descriptor that follows each record and in its central-directory entry, so the file is
a genuine zip that ``torch.load(weights_only=True)``, Python's ``zipfile`` and any zip tool
read and verify; ``verify_torch_file`` (``zipdir``) checks them without loading anything.
"""
from __future__ import annotations

import io
import struct
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import IntegrityError
from ..storage.xattr import attrs_for
from .checksum import crc32
from .health import (HEALTH_ATTR, attr_bytes, content_tie, sidecar_bytes, sidecar_path, storage_dtype,
                     uses_sidecar)
from .layout import CheckpointInfo, FileRecord
from .torchrecords import hash_staged, write_with_records
# the reading side lives in zipdir; its public checks are re-exported here, where integrations have always found them
from .zipdir import (DESC_SIG, Sparse, central_entries, crc_less, data_offset, directory_digest, is_zip,
                     record_spans, verify_torch_bytes, verify_torch_file)


__all__ = ["TorchRecord", "TorchFileLayout", "TorchFileFormat", "plan_torch_file", "verify_torch_file",
           "verify_torch_bytes", "is_zip", "storage_bytes", "record_spans", "crc_less"]


@dataclass(frozen=True)
class TorchRecord:
    """One storage's bytes in the file."""

    key: str  # the record is ``<archive>/data/<key>``
    storage: Any  # the source ``torch.UntypedStorage`` (CPU or CUDA)
    offset: int  # where its bytes start in the file
    nbytes: int
    descriptor_crc: int  # file offset of the CRC-32 field in its data descriptor (-1: empty, none to fill)
    central_crc: int  # file offset of the CRC-32 field in its central-directory entry (-1: empty)
    dtype: str = ""  # the storage type torch pickled (``FloatStorage``): ranks sharing a file compare it


@dataclass(frozen=True)
class TorchFileLayout:
    """A torch checkpoint file minus its storage bytes."""

    size: int  # bytes in the finished file
    segments: tuple[tuple[int, bytes], ...]  # (offset, bytes) of everything that is not storage data
    records: tuple[TorchRecord, ...]  # in file order


class _Recorder(io.RawIOBase):
    """A write-only stream that keeps what is written and only remembers where it skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.segments: list[tuple[int, bytes]] = []
        self.pos = 0
        self.end = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        if self.segments and self.segments[-1][0] + len(self.segments[-1][1]) == self.pos:
            off, prev = self.segments[-1]
            self.segments[-1] = (off, prev + data)  # coalesce: the headers of one record come in pieces
        else:
            self.segments.append((self.pos, data))
        self.pos += len(data)
        self.end = max(self.end, self.pos)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.end}[whence]
        self.pos = base + offset
        self.end = max(self.end, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos


def _recording_pickle_module(storages: dict[str, Any], dtypes: dict[str, str]) -> Any:
    """A ``pickle_module`` for ``torch.save`` whose pickler also tells us which storage got which key.

    torch's pickler subclass overrides ``persistent_id``; the C pickler reads that method once, in
    ``__init__``, so we wrap it there through the C type's own ``persistent_id`` setter.
    """
    import _pickle

    setter = _pickle.Pickler.__dict__["persistent_id"]

    class RecordingPickler(_pickle.Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            inner = self.persistent_id

            def persistent_id(obj: Any) -> Any:
                pid = inner(obj)
                if pid is not None:  # ("storage", type, key, location, numel)
                    storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                    storages.setdefault(pid[2], storage)
                    dtypes.setdefault(pid[2], getattr(pid[1], "__name__", str(pid[1])))
                return pid

            setter.__set__(self, persistent_id)

    import pickle

    return types.SimpleNamespace(Pickler=RecordingPickler, Unpickler=pickle.Unpickler, __name__="pickle")


def plan_torch_file(obj: Any) -> TorchFileLayout:
    """Run ``torch.save(obj)`` without its data and return the file's layout (milliseconds: no tensor bytes move)."""
    storages: dict[str, Any] = {}
    dtypes: dict[str, str] = {}
    out = _Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage deprecation, from torch's own pickler
        with torch.serialization.skip_data():
            torch.save(obj, out, pickle_module=_recording_pickle_module(storages, dtypes))
    segments = tuple(out.segments)
    size = out.end
    view = Sparse(segments, size)
    records = []
    for name, header, central in central_entries(view):
        if not name.startswith("data/"):
            continue
        key = name[len("data/"):]
        if key not in storages:
            raise IntegrityError(f"torch.save wrote record {name!r} for no storage it reported; "
                                 "this torch version is not supported by fastckpt's torch file writer")
        nbytes = storages[key].nbytes()
        offset = data_offset(view, header)
        desc = offset + nbytes
        if nbytes == 0:  # an empty record's CRC is 0, already right, and it has no data descriptor
            records.append(TorchRecord(key, storages[key], offset, 0, -1, -1, dtypes.get(key, "")))
            continue
        if view.read(desc, 4) != DESC_SIG:
            raise IntegrityError(f"no data descriptor after record {name!r}: unsupported torch zip layout")
        records.append(TorchRecord(key, storages[key], offset, nbytes, desc + 4, central + 16, dtypes.get(key, "")))
    if len(records) != len(storages):
        raise IntegrityError(f"torch.save reported {len(storages)} storages but wrote {len(records)} records")
    return TorchFileLayout(size, segments, tuple(sorted(records, key=lambda r: r.offset)))


def storage_bytes(storage: Any) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage`` (torch saves whole storages, not the viewed part)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


# ---- the engine's side: one save of one torch file -------------------------------------------------------------


@dataclass(eq=False)
class TorchFileFormat:
    """How the pipeline writes one ``.ckpt``: the staged storages are the records of ``layout``.

    Table entry ``i`` of the save's plan is record ``i`` (a flat uint8 view of its storage), so the
    I/O workers only checksum staged shards, and the committer writes the fixed bytes and the staged
    records back to back as one new file that appears under ``path`` only once it is complete.
    """

    layout: TorchFileLayout
    path: str
    # each record's CRC-32 by shard, when the I/O worker's health pass took it (healthpass.py): no second read
    pass_crcs: dict[int, list[int]] = field(default_factory=dict)
    pass_checksum = staticmethod(crc32)  # the checksum that pass takes: zlib's CRC-32, which the zip fields need
    catalogued = False  # a framework's file (Lightning's): not listed, retained or uploaded by fastckpt
    keeps_shards = True  # the records are written back to back at the commit, from the slot

    @classmethod
    def plan(cls, state: Any, path: str) -> tuple["TorchFileFormat", list[torch.Tensor], list[str], list[torch.Tensor]]:
        """Called by ``save_file``: the format, the tensors to stage (one per record), their names, and for each a
        tensor of the state on that storage (whose version counter the mutation guard watches: the flat view
        staged here has a counter of its own)."""
        layout = plan_torch_file(state)
        tensors = [storage_bytes(r.storage) for r in layout.records]
        found = _storage_tensors(state)  # errors name "state_dict/layer.weight", not "data/3"
        where = [found.get((str(r.storage.device), r.storage.data_ptr())) for r in layout.records]
        keys = [w[0] if w else f"data/{r.key}" for w, r in zip(where, layout.records)]
        sources = [w[1] if w else t for w, t in zip(where, tensors)]
        return cls(layout, path), tensors, keys, sources

    def value_dtype(self, entry: Any) -> torch.dtype:
        """The dtype of a staged record's values (its health statistics): the storage type torch pickled."""
        return storage_dtype(self.layout.records[entry.index].dtype)

    def checksum(self, data: memoryview, entries: Any) -> dict[int, int]:
        """Called by an I/O worker once a shard is staged: the CRC-32 of each record it holds."""
        return {e.index: crc32(data[e.offset:e.offset + e.nbytes]) for e in entries}

    def write_shard(self, storage: Any, snap: Any, shard: Any, data: memoryview) -> tuple[int, Any, list[int]]:
        """``FileFormat``: called by an I/O worker once a shard is staged; checksums it (the commit writes it)."""
        taken = self.pass_crcs.pop(shard.index, None)
        crcs = (dict(zip((e.index for e in shard.entries), taken)) if taken is not None
                else self.checksum(data, shard.entries))
        # on an object store with dedup, each record's content hash too (torchrecords.py), here on the I/O worker
        hashes = hash_staged(data, shard.entries) if getattr(snap, "dedup", None) is not None else None
        return shard.index, FileRecord("", 0, 0, hashes), [crcs[e.index] for e in shard.entries]

    def commit(self, storage: Any, snap: Any, results: Any, staged: Any, pool: Any) -> tuple[CheckpointInfo, int]:
        """``FileFormat``: called by the committer; writes the file under a temporary name, then renames it (the
        commit point)."""
        views, crcs = staged()
        health = snap.health_doc
        if health is not None and not uses_sidecar(storage):
            record = attr_bytes(health, snap.step, self.layout.size, content_tie(self, crcs))
            size = self._write_with_attr(storage, views, crcs, record)
        elif uses_sidecar(storage):  # an object store: no attributes, hidden sidecars beside the file
            sidecar = sidecar_path(self.path)
            if health is not None:
                storage.delete(sidecar)  # an older file's: gone before this file takes the name (a crash: no record)
            # the ranges the folder's newest file holds are copied server-side; then the records sidecar
            size = write_with_records(storage, self, views, crcs, results, getattr(snap, "dedup", None))
            if health is not None:
                storage.write_atomic(sidecar, sidecar_bytes(health, snap.step, size, content_tie(self, crcs)))
        else:
            size = self.write(storage, views, crcs)
        return CheckpointInfo(snap.name, snap.step, self.path, size, healthy=None if health is None
                              else health["healthy"]), size

    def _write_with_attr(self, storage: Any, views: dict[int, memoryview], crcs: dict[int, int], record: bytes) -> int:
        """A local file, its health record in its extended attribute (never inside it: torch.load reads the file
        unchanged, and no other name appears in the folder): set before the file is named, or right after where
        a wrapper storage wrote it some other way (briefly unknown, never wrong)."""
        attrs = {HEALTH_ATTR: record}
        with attrs_for(self.path, attrs) as given:
            size = self.write(storage, views, crcs)
        if not given.tried:
            storage.set_attrs(self.path, attrs)
        return size

    def discard(self, storage: Any, snap: Any) -> None:
        """``FileFormat``: nothing to remove; ``write_file_atomic`` leaves nothing behind when it fails."""

    def write(self, storage: Any, views: dict[int, memoryview], crcs: dict[int, int]) -> int:
        """The whole file from the staged records (by table index) and their CRC-32s, published atomically."""
        storage.write_file_atomic(self.path, self.parts(views, crcs))
        return self.layout.size

    def parts(self, views: dict[int, memoryview], crcs: dict[int, int]) -> list[memoryview]:
        """Called by the committer: the whole file as buffers, fixed bytes (CRCs filled in) around records."""
        out: list[memoryview] = []
        for i, (_, gap) in enumerate(self.fixed(crcs)):
            out.append(memoryview(gap))
            if i < len(self.layout.records) and self.layout.records[i].nbytes:
                out.append(views[i])
        return [p for p in out if len(p)]

    def fixed(self, crcs: dict[int, int]) -> list[tuple[int, bytearray]]:
        """Everything but the records' bytes, CRC-32 fields filled in: ``(offset, bytes)`` of the gap before each
        record, then of the tail (the central directory). Ranks sharing the file write the records; one writes this."""
        size, recs = self.layout.size, self.layout.records
        fields = self._crc_fields(crcs)
        sparse = Sparse(self.layout.segments, size)
        out: list[tuple[int, bytearray]] = []
        cursor = 0
        for r in recs:
            out.append((cursor, _patched(sparse, cursor, r.offset, fields)))
            cursor = r.offset + r.nbytes
        out.append((cursor, _patched(sparse, cursor, size, fields)))
        return out

    def directory_digest(self, crcs: dict[int, int]) -> str:
        """The ``zipdir.directory_digest`` of the finished file (the records' CRC-32s filled in): what its health
        record is tied to. Only the tail after the last record is built: the zip directory lies there."""
        recs, size = self.layout.records, self.layout.size
        start = max((r.offset + r.nbytes for r in recs), default=0)
        tail = _patched(Sparse(self.layout.segments, size), start, size, self._crc_fields(crcs))
        return directory_digest(Sparse(((start, bytes(tail)),), size))

    def _crc_fields(self, crcs: dict[int, int]) -> dict[int, bytes]:
        """Each record's CRC-32 (by table index in ``crcs``) as the bytes of its two fields, by file offset."""
        fields = {}
        for i, r in enumerate(self.layout.records):
            if r.nbytes:
                fields[r.descriptor_crc] = fields[r.central_crc] = struct.pack("<I", crcs[i])
        return fields

    def signature(self) -> list[tuple[int, str]]:
        """Each record's size and storage type, in file order: what ranks sharing one file must agree on (their
        offsets may differ, as the pickled bytes around the records may)."""
        return [(r.nbytes, r.dtype) for r in self.layout.records]


def _storage_tensors(state: Any) -> dict[tuple[str, int], tuple[str, torch.Tensor]]:
    """The first tensor found on each storage and its key path (containers walked, nothing else)."""
    names: dict[tuple[str, int], tuple[str, torch.Tensor]] = {}
    stack: list[tuple[str, Any, int]] = [("", state, 0)]
    while stack:
        path, obj, depth = stack.pop()
        if isinstance(obj, torch.Tensor):
            if obj.layout is torch.strided and obj.device.type != "meta":
                names.setdefault((str(obj.device), obj.untyped_storage().data_ptr()), (path or "tensor", obj))
        elif depth < 64 and isinstance(obj, dict):
            stack.extend((f"{path}/{k}" if path else str(k), v, depth + 1) for k, v in reversed(list(obj.items())))
        elif depth < 64 and isinstance(obj, (list, tuple)):
            stack.extend((f"{path}/{i}" if path else str(i), v, depth + 1) for i, v in reversed(list(enumerate(obj))))
    return names


def _patched(sparse: Sparse, start: int, end: int, fields: dict[int, bytes]) -> bytearray:
    gap = bytearray(sparse.read(start, end - start))
    for off, value in fields.items():
        if start <= off and off + len(value) <= end:
            gap[off - start:off - start + len(value)] = value
    return gap
