"""The zip structure of a torch checkpoint file, read as data: its records and their CRC-32 checks.

``torch.save`` writes a zip of stored (never compressed) records; torch's reader (miniz) finds a record by its name,
case-insensitively, under the archive's folder. Everything here treats the file as hostile until parsed: every
offset is bounded by the file, every zip64 field is read by what it replaces, and every error is an
``IntegrityError`` (the public functions name the file).
"""
from __future__ import annotations

import bisect
import mmap
import os
import struct
from typing import Any, Callable, Iterator

import xxhash

from ..errors import IntegrityError
from .checksum import crc32
from ..storage.local import open_regular


__all__ = ["DESC_SIG", "Sparse", "central_entries", "central_records", "crc_less", "data_offset", "directory_digest",
           "is_zip", "read_directory", "record_spans", "verify_torch_bytes", "verify_torch_file"]

_LOCAL_SIG, DESC_SIG, _CENTRAL_SIG = b"PK\x03\x04", b"PK\x07\x08", b"PK\x01\x02"
_EOCD_SIG, _EOCD64_SIG, _LOC64_SIG = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"
_U32 = 0xFFFFFFFF  # a 32-bit zip field that says "see the zip64 extra field"
_CRC_STEP = 16 << 20  # bytes checksummed between two progress reports (large enough to stay at full speed)
_DIR_TAIL = 64 << 10  # read first by ``read_directory``: the whole directory of a file of up to ~500 records
_DIR_LIMIT = 64 << 20  # a larger directory (~500,000 records) is not a torch file's: refused, never read
Progress = Callable[[int], None]


def verify_torch_file(path: str, progress: Progress | None = None) -> list[str]:
    """Check every record's CRC-32 against its bytes; one line per problem (empty: the file is sound).
    ``progress(n)`` is told of each ``n`` bytes checked, a step at a time, so that a large file's check shows."""
    try:
        with os.fdopen(open_regular(path), "rb") as f:  # a FIFO or a device is refused before any read
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return [f"{path}: empty file, not a torch checkpoint"]
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                mv = memoryview(mm)
                try:
                    return [f"{path}: {p}" for p in _check_records(_Mapped(mv, size), progress)]
                finally:
                    mv.release()
    except IntegrityError as e:
        return [f"{path}: {e}"]
    except (OSError, struct.error, ValueError, IndexError) as e:
        return [f"{path}: not a readable torch checkpoint file: {e}"]


def verify_torch_bytes(data: bytes | memoryview, source: str, progress: Progress | None = None) -> list[str]:
    """``verify_torch_file`` for a file already in memory (a remote object read once)."""
    mv = memoryview(data)
    try:
        return [f"{source}: {p}" for p in _check_records(_Mapped(mv, len(mv)), progress)]
    except IntegrityError as e:
        return [f"{source}: {e}"]
    except (struct.error, ValueError, IndexError) as e:
        return [f"{source}: not a readable torch checkpoint file: {e}"]
    finally:
        mv.release()


def is_zip(head: bytes) -> bool:
    """Whether a file starting with ``head`` is a zip (torch's format since 1.6; older files are raw pickles)."""
    return head[:4] == _LOCAL_SIG


def _records(view: Any) -> Iterator[tuple[str, int, int, int]]:
    """Every zip entry of ``view``: (name, data offset, size, CRC-32 its entry records), in directory order."""
    for name, header, usize, want in central_records(view):
        yield name, data_offset(view, header), usize, want


def central_records(view: Any) -> Iterator[tuple[str, int, int, int]]:
    """Every zip entry of ``view`` as its central directory records it: (name, local header offset, size, CRC-32),
    in directory order. Reads only the directory (``view.read``), never the local headers: what a reader that
    has the end of a file but not yet its records can know (``fastckpt.read.zipcheck``)."""
    for name, header, central in central_entries(view):
        (method,) = struct.unpack("<H", view.read(central + 10, 2))
        want, csize, usize = struct.unpack("<III", view.read(central + 16, 12))
        if usize == _U32 or csize == _U32:
            n, e = struct.unpack("<HH", view.read(central + 28, 4))
            (offset32,) = struct.unpack("<I", view.read(central + 42, 4))
            wide = _zip64_fields(view.read(central + 46 + n, e), usize, csize, offset32, name)
            usize, csize = wide.get("size", usize), wide.get("compressed size", csize)
        if method != 0 or csize != usize:
            # torch.save stores every record as it is; the fast readers view records in place, so a compressed
            # one would be read as its compressed bytes (torch.load would inflate it)
            raise IntegrityError(f"record {name!r} is compressed (method {method}, {csize} bytes for {usize}); "
                                 "torch.save never compresses a record: not a torch checkpoint, or damaged")
        yield name, header, usize, want


def crc_less(spans: list[tuple[str, int, int, int]]) -> bool:
    """Whether no non-empty record of ``spans`` carries a CRC-32: the file was written with torch's crc32 option
    off (``torch.serialization.set_crc32_options(False)`` zeroes them all), so there is nothing to check. In a file
    with CRC-32s, a record whose CRC-32 reads 0 is checked like any other (damage does not get to opt out)."""
    return all(want == 0 for _, _, size, want in spans if size)


def _check_records(view: "_Mapped", progress: Progress | None = None) -> list[str]:
    problems = []
    spans = list(_records(view))
    unchecked = crc_less(spans)
    for name, offset, usize, want in spans:
        if offset + usize > view.size:
            problems.append(f"record {name!r} runs past the end of the file (truncated)")
            continue
        if unchecked:
            continue  # written with torch's crc32 option off: nothing to check against
        got = 0
        for at in range(offset, offset + usize, _CRC_STEP):  # a step at a time: progress moves inside a record
            end = min(at + _CRC_STEP, offset + usize)
            got = crc32(view.mv[at:end], got)
            if progress is not None:
                progress(end - at)
        if got != want:
            problems.append(f"record {name!r} has CRC-32 {got:08x}, its zip entry says {want:08x}")
    return problems


# ---- reading the zip structure --------------------------------------------------------------------------------


class Sparse:
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


def _directory(view: Any) -> tuple[int, int]:
    """(entries, offset) of the central directory, from the end-of-central-directory records at the end of
    ``view`` (its zip64 ones where the 32-bit fields overflow)."""
    if view.size < 22 or view.read(view.size - 22, 4) != _EOCD_SIG:
        raise IntegrityError("no zip end-of-central-directory record at the end of the file: not a torch "
                             "checkpoint, or truncated")
    count, cd_size, cd_off = struct.unpack("<HII", view.read(view.size - 22 + 10, 10))
    if cd_off == _U32 or count == 0xFFFF:
        loc = view.size - 22 - 20
        if loc < 0 or view.read(loc, 4) != _LOC64_SIG:
            raise IntegrityError("a zip64 archive without its zip64 locator")
        (eocd64,) = struct.unpack("<Q", view.read(loc + 8, 8))
        if view.read(eocd64, 4) != _EOCD64_SIG:
            raise IntegrityError("the zip64 locator points at no zip64 end-of-central-directory record")
        count, cd_size, cd_off = struct.unpack("<QQQ", view.read(eocd64 + 32, 24))
    return count, cd_off


def read_directory(read: Callable[[int, int], bytes], size: int) -> Sparse:
    """The zip directory of a file of ``size`` bytes, read with ``read(offset, n)`` (exactly ``n`` bytes): its
    last 64 KiB, then the rest of the directory where it starts before them; every other byte reads as zero. Two
    reads at most, so a health record's check (``directory_digest``) costs a few KiB even on an object store.
    Raises ``IntegrityError`` where the end records are missing or the directory is implausibly large."""
    n = min(size, _DIR_TAIL)
    tail = (size - n, read(size - n, n))
    _, start = _directory(Sparse((tail,), size))
    if start >= tail[0]:
        return Sparse((tail,), size)
    if size - start > _DIR_LIMIT:
        raise IntegrityError(f"a zip directory of {size - start} bytes: not a torch checkpoint's")
    return Sparse(((start, read(start, tail[0] - start)), tail), size)


def directory_digest(view: Any) -> str:
    """The xxh3-64 (hex) of every zip entry's name, size and CRC-32, in directory order: the CRC-32s that a torch
    file's writer measured over each record's bytes, summed up in 16 hex digits. A health record holds the digest
    of the file it was measured on (format/health.py): other bytes under that name (``cp other.ckpt a.ckpt`` keeps
    the inode, and with it the attribute) give another digest. Reads only the directory (``read_directory``)."""
    digest = xxhash.xxh3_64()
    for name, _, usize, crc in central_records(view):
        digest.update(f"{name}\0{usize}\0{crc:08x}\n".encode())
    return digest.hexdigest()


def central_entries(view: Any) -> list[tuple[str, int, int]]:
    """(name without the archive prefix, local header offset, central entry offset) of every zip entry."""
    count, cd_off = _directory(view)
    entries, pos = [], cd_off
    for _ in range(count):  # bounded: each entry is at least 46 bytes, and a read past the end raises
        if view.read(pos, 4) != _CENTRAL_SIG:
            raise IntegrityError(f"corrupt zip central directory at offset {pos}")
        csize, usize = struct.unpack("<II", view.read(pos + 20, 8))
        n, e, c = struct.unpack("<HHH", view.read(pos + 28, 6))
        (header,) = struct.unpack("<I", view.read(pos + 42, 4))
        name = view.read(pos + 46, n).decode("utf-8", "replace")
        name = name.split("/", 1)[-1] if "/" in name else name
        if header == _U32:
            header = _zip64_fields(view.read(pos + 46 + n, e), usize, csize, header, name)["header offset"]
        entries.append((name, header, pos))
        pos += 46 + n + e + c
    return entries


def data_offset(view: Any, header: int) -> int:
    if view.read(header, 4) != _LOCAL_SIG:
        raise IntegrityError(f"no zip local header at offset {header}")
    n, e = struct.unpack("<HH", view.read(header + 26, 4))
    return header + 30 + n + e


def _zip64_fields(extra: bytes, usize: int, csize: int, header: int, name: str) -> dict[str, int]:
    """The 64-bit values of an entry's zip64 extra field, by what they replace. The field holds, in this order, only
    those of the size, the compressed size and the local header offset whose 32-bit field reads 0xFFFFFFFF (the
    zip spec; miniz, torch's reader, reads them the same way), so which value is which depends on the entry."""
    wanted = [what for what, value in (("size", usize), ("compressed size", csize), ("header offset", header))
              if value == _U32]
    pos = 0
    while pos + 4 <= len(extra):
        tag, length = struct.unpack("<HH", extra[pos:pos + 4])
        if pos + 4 + length > len(extra):
            raise IntegrityError(f"record {name!r}: an extra field of {length} bytes runs past the entry's "
                                 f"{len(extra)}-byte extra data (a malformed zip entry)")
        if tag == 0x0001:
            values = struct.unpack(f"<{length // 8}Q", extra[pos + 4:pos + 4 + length // 8 * 8])
            if len(values) < len(wanted):
                raise IntegrityError(f"record {name!r}: its zip64 extra field holds {len(values)} value(s), the "
                                     f"entry needs {len(wanted)} ({', '.join(wanted)}) (a malformed zip entry)")
            return dict(zip(wanted, values))
        pos += 4 + length
    raise IntegrityError(f"record {name!r}: its {' and '.join(wanted)} overflow{'s' if len(wanted) == 1 else ''} 32 "
                         "bits but the entry has no zip64 extra field (a malformed zip entry)")


def record_spans(path: str, data: memoryview | None = None) -> list[tuple[str, int, int, int]]:
    """(name, data offset, size, CRC-32 from the central directory) of every record of the torch zip at ``path``:
    what a parallel reader (``fastckpt.read.torchzip``) needs. ``data``: the file's bytes, already read or mapped
    (parsed there instead of mapping the file again). Raises ``IntegrityError`` naming ``path`` on a malformed zip."""
    if data is not None:
        return _spans(path, data)
    with os.fdopen(open_regular(path), "rb") as f:  # a FIFO or a device is refused before any read
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
    try:
        spans = list(_records(_Mapped(mv, size)))
    except IntegrityError as e:
        raise IntegrityError(f"{path}: {e}") from e
    except (struct.error, ValueError, IndexError) as e:  # defence in depth: a parse error is the file's fault
        raise IntegrityError(f"{path}: not a readable torch checkpoint file (malformed zip: {e})") from e
    seen: dict[str, str] = {}
    for name, offset, usize, _ in spans:
        if offset + usize > size:
            raise IntegrityError(f"{path}: record {name!r} runs past the end of the file (truncated)")
        # torch's reader (miniz) finds a record by a case-insensitive name: with two such names, which one it reads
        # is up to its search order, so neither may be trusted to be the one checked or measured here
        other = seen.setdefault(name.lower(), name)
        if other is not name:
            raise IntegrityError(f"{path}: records {other!r} and {name!r} differ only in case; torch would read "
                                 "either as the same record: not a file torch.save wrote (damaged or crafted)")
    return spans
