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
read and verify; ``verify_torch_file`` checks them without loading anything.
"""
from __future__ import annotations

import bisect
import io
import mmap
import os
import struct
import types
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ..errors import IntegrityError
from ..storage.local import open_regular
from .layout import CheckpointInfo, FileRecord

try:  # 5x the speed of the stdlib's crc32 here, and it releases the GIL on large buffers
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - the dependency is declared; keep working without it
    _crc32 = zlib.crc32

__all__ = ["TorchRecord", "TorchFileLayout", "TorchFileFormat", "plan_torch_file", "verify_torch_file",
           "verify_torch_bytes", "is_zip", "storage_bytes"]

_LOCAL_SIG, _DESC_SIG, _CENTRAL_SIG = b"PK\x03\x04", b"PK\x07\x08", b"PK\x01\x02"
_EOCD_SIG, _EOCD64_SIG, _LOC64_SIG = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"


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
    view = _Sparse(segments, size)
    records = []
    for name, header, central in _central_entries(view):
        if not name.startswith("data/"):
            continue
        key = name[len("data/"):]
        if key not in storages:
            raise IntegrityError(f"torch.save wrote record {name!r} for no storage it reported; "
                                 "this torch version is not supported by fastckpt's torch file writer")
        nbytes = storages[key].nbytes()
        offset = _data_offset(view, header)
        desc = offset + nbytes
        if nbytes == 0:  # an empty record's CRC is 0, already right, and it has no data descriptor
            records.append(TorchRecord(key, storages[key], offset, 0, -1, -1, dtypes.get(key, "")))
            continue
        if view.read(desc, 4) != _DESC_SIG:
            raise IntegrityError(f"no data descriptor after record {name!r}: unsupported torch zip layout")
        records.append(TorchRecord(key, storages[key], offset, nbytes, desc + 4, central + 16, dtypes.get(key, "")))
    if len(records) != len(storages):
        raise IntegrityError(f"torch.save reported {len(storages)} storages but wrote {len(records)} records")
    return TorchFileLayout(size, segments, tuple(sorted(records, key=lambda r: r.offset)))


def storage_bytes(storage: Any) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage`` (torch saves whole storages, not the viewed part)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def verify_torch_file(path: str) -> list[str]:
    """Check every record's CRC-32 against its bytes; one line per problem (empty: the file is sound)."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:  # a FIFO or a device is refused before any read
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return [f"{path}: empty file, not a torch checkpoint"]
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                mv = memoryview(mm)
                try:
                    return [f"{path}: {p}" for p in _check_records(_Mapped(mv, size))]
                finally:
                    mv.release()
    except IntegrityError as e:
        return [f"{path}: {e}"]
    except (OSError, struct.error, ValueError) as e:
        return [f"{path}: not a readable torch checkpoint file: {e}"]


def verify_torch_bytes(data: bytes | memoryview, source: str) -> list[str]:
    """``verify_torch_file`` for a file already in memory (a remote object read once)."""
    mv = memoryview(data)
    try:
        return [f"{source}: {p}" for p in _check_records(_Mapped(mv, len(mv)))]
    except IntegrityError as e:
        return [f"{source}: {e}"]
    except (struct.error, ValueError) as e:
        return [f"{source}: not a readable torch checkpoint file: {e}"]
    finally:
        mv.release()


def is_zip(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a zip (torch's format since 1.6; older files are raw pickles)."""
    return head[:4] == _LOCAL_SIG


def _records(view: Any) -> Iterator[tuple[str, int, int, int]]:
    """Every zip entry of ``view``: (name, data offset, size, CRC-32 its entry records), in directory order."""
    for name, header, central in _central_entries(view):
        want, csize, usize = struct.unpack("<III", view.read(central + 16, 12))
        if usize == 0xFFFFFFFF or csize == 0xFFFFFFFF:
            usize = _zip64_size(view, central)
        yield name, _data_offset(view, header), usize, want


def _check_records(view: "_Mapped") -> list[str]:
    problems = []
    for name, offset, usize, want in _records(view):
        if offset + usize > view.size:
            problems.append(f"record {name!r} runs past the end of the file (truncated)")
            continue
        if want == 0 and usize:
            continue  # written with torch's crc32 option off: nothing to check against
        got = _crc32(view.mv[offset:offset + usize]) & 0xFFFFFFFF
        if got != want:
            problems.append(f"record {name!r} has CRC-32 {got:08x}, its zip entry says {want:08x}")
    return problems


# ---- reading the zip structure --------------------------------------------------------------------------------


class _Sparse:
    """Random reads over recorded segments (sorted, disjoint); holes read as zeros."""

    def __init__(self, segments: tuple[tuple[int, bytes], ...], size: int) -> None:
        self.segments, self.size = segments, size
        self._starts = [off for off, _ in segments]

    def read(self, offset: int, n: int) -> bytes:
        out = bytearray(n)
        # the segment that may hold ``offset``, then those after it up to ``offset + n`` (a binary search: a
        # skeleton has two segments per storage, and the central directory is read entry by entry)
        i = max(bisect.bisect_right(self._starts, offset) - 1, 0)
        while i < len(self.segments) and self.segments[i][0] < offset + n:
            off, data = self.segments[i]
            lo, hi = max(off, offset), min(off + len(data), offset + n)
            if lo < hi:
                out[lo - offset:hi - offset] = data[lo - off:hi - off]
            i += 1
        return bytes(out)


class _Mapped:
    def __init__(self, mv: memoryview, size: int) -> None:
        self.mv, self.size = mv, size

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or offset + n > self.size:
            raise IntegrityError(f"zip structure points past the end of the file (offset {offset}, {n} bytes)")
        return bytes(self.mv[offset:offset + n])


def _central_entries(view: Any) -> list[tuple[str, int, int]]:
    """(name without the archive prefix, local header offset, central entry offset) of every zip entry."""
    if view.size < 22 or view.read(view.size - 22, 4) != _EOCD_SIG:
        raise IntegrityError("no zip end-of-central-directory record at the end of the file: not a torch "
                             "checkpoint, or truncated")
    count, cd_size, cd_off = struct.unpack("<HII", view.read(view.size - 22 + 10, 10))
    if cd_off == 0xFFFFFFFF or count == 0xFFFF:
        loc = view.size - 22 - 20
        if view.read(loc, 4) != _LOC64_SIG:
            raise IntegrityError("a zip64 archive without its zip64 locator")
        (eocd64,) = struct.unpack("<Q", view.read(loc + 8, 8))
        if view.read(eocd64, 4) != _EOCD64_SIG:
            raise IntegrityError("the zip64 locator points at no zip64 end-of-central-directory record")
        count, cd_size, cd_off = struct.unpack("<QQQ", view.read(eocd64 + 32, 24))
    entries, pos = [], cd_off
    for _ in range(count):
        if view.read(pos, 4) != _CENTRAL_SIG:
            raise IntegrityError(f"corrupt zip central directory at offset {pos}")
        n, e, c = struct.unpack("<HHH", view.read(pos + 28, 6))
        (header,) = struct.unpack("<I", view.read(pos + 42, 4))
        name = view.read(pos + 46, n).decode("utf-8", "replace")
        if header == 0xFFFFFFFF:
            csize, usize = struct.unpack("<II", view.read(pos + 20, 8))
            index = (usize == 0xFFFFFFFF) + (csize == 0xFFFFFFFF)  # zip64 extra: sizes first, then the offset
            header = _zip64_values(view.read(pos + 46 + n, e), "header offset")[index]
        entries.append((name.split("/", 1)[-1] if "/" in name else name, header, pos))
        pos += 46 + n + e + c
    return entries


def _data_offset(view: Any, header: int) -> int:
    if view.read(header, 4) != _LOCAL_SIG:
        raise IntegrityError(f"no zip local header at offset {header}")
    n, e = struct.unpack("<HH", view.read(header + 26, 4))
    return header + 30 + n + e


def _zip64_size(view: Any, central: int) -> int:
    n, e = struct.unpack("<HH", view.read(central + 28, 4))
    return _zip64_values(view.read(central + 46 + n, e), "size")[0]  # the uncompressed size comes first


def _zip64_values(extra: bytes, what: str) -> list[int]:
    """The 64-bit values of a zip64 extra field: those of size, compressed size, offset that overflow, in order."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack("<HH", extra[pos:pos + 4])
        if tag == 0x0001 and length >= 8 and pos + 4 + length <= len(extra):
            return list(struct.unpack(f"<{length // 8}Q", extra[pos + 4:pos + 4 + length // 8 * 8]))
        pos += 4 + length
    raise IntegrityError(f"a zip entry's {what} overflows 32 bits but it has no zip64 extra field")


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

    def checksum(self, data: memoryview, entries: Any) -> dict[int, int]:
        """Called by an I/O worker once a shard is staged: the CRC-32 of each record it holds."""
        return {e.index: _crc32(data[e.offset:e.offset + e.nbytes]) & 0xFFFFFFFF for e in entries}

    def write_shard(self, storage: Any, snap: Any, shard: Any, data: memoryview) -> tuple[int, Any, list[int]]:
        """``FileFormat``: called by an I/O worker once a shard is staged; checksums it (the commit writes it)."""
        crcs = self.checksum(data, shard.entries)
        return shard.index, FileRecord("", 0, 0), [crcs[e.index] for e in shard.entries]

    def commit(self, storage: Any, snap: Any, results: Any, staged: Any, pool: Any) -> tuple[CheckpointInfo, int]:
        """``FileFormat``: called by the committer; writes the file under a temporary name, then renames it (the
        commit point)."""
        views, crcs = staged()
        size = self.write(storage, views, crcs)
        return CheckpointInfo(snap.name, snap.step, self.path, size), size

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
        fields = {}
        for i, r in enumerate(recs):
            if r.nbytes:
                fields[r.descriptor_crc] = fields[r.central_crc] = struct.pack("<I", crcs[i])
        sparse = _Sparse(self.layout.segments, size)
        out: list[tuple[int, bytearray]] = []
        cursor = 0
        for r in recs:
            out.append((cursor, _patched(sparse, cursor, r.offset, fields)))
            cursor = r.offset + r.nbytes
        out.append((cursor, _patched(sparse, cursor, size, fields)))
        return out

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


def _patched(sparse: _Sparse, start: int, end: int, fields: dict[int, bytes]) -> bytearray:
    gap = bytearray(sparse.read(start, end - start))
    for off, value in fields.items():
        if start <= off and off + len(value) <= end:
            gap[off - start:off - start + len(value)] = value
    return gap


def record_spans(path: str, data: memoryview | None = None) -> list[tuple[str, int, int, int]]:
    """(name, data offset, size, CRC-32 from the central directory) of every record of the torch zip at ``path``:
    what a parallel reader (``fastckpt.read.torchzip``) needs. ``data``: the file's bytes, already read or mapped
    (parsed there instead of mapping the file again). Raises ``IntegrityError`` on a malformed zip."""
    if data is not None:
        return _spans(path, data)
    with os.fdopen(open_regular(path), "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise IntegrityError(f"{path}: empty file, not a torch checkpoint")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            mv = memoryview(mm)
            try:
                return _spans(path, mv)
            finally:
                mv.release()


def _spans(path: str, mv: memoryview) -> list[tuple[str, int, int, int]]:
    size = len(mv)
    if size == 0:
        raise IntegrityError(f"{path}: empty file, not a torch checkpoint")
    view = _Mapped(mv, size)
    out = []
    for name, offset, usize, want in _records(view):
        if offset + usize > size:
            raise IntegrityError(f"{path}: record {name!r} runs past the end of the file (truncated)")
        out.append((name, offset, usize, want))
    return out
