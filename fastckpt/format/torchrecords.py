"""The content records of a torch file on an object store (Lightning's ``.ckpt`` in an ``s3://`` dirpath), kept in
a hidden sidecar beside it (``.NAME.fastckpt-records``), so the next file of the folder copies its unchanged
ranges server-side instead of sending them (``objectdedup.py``).

``torch.save`` lays the records out at 64-byte-aligned offsets after ``data.pkl``, whose length changes between
saves, so ranges are matched by content hash, not by offset. The I/O workers hash each staged record; the
committer hashes the fixed bytes around them, reads the records of the folder's newest ``.ckpt`` from its sidecar
(never the old object itself), plans, uploads, then writes the new file's sidecar. The object stays a byte-exact
stock torch file. A sidecar that is missing, malformed, or whose object's size or stored CRC32C no longer match
(the file was replaced or rewritten by someone else) gives no copy source: everything is sent. A sidecar that
lies about the bytes costs only bytes: every copied part's CRC32C is checked against the local bytes
(``storage/s3copy.py``) and what differs is sent.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Sequence

import xxhash

from ..errors import FastCkptError, IntegrityError
from ..storage.joined import Joined
from ..storage.partplan import Record, SourceRecord
from .contenthash import FIELD, file_records
from .objectdedup import plan_object

__all__ = ["RECORDS_SUFFIX", "folder_source", "hash_staged", "parse_records", "records_path", "tiling",
           "write_records",
           "write_with_records"]

log = logging.getLogger("fastckpt")

RECORDS_SUFFIX = ".fastckpt-records"
_FORMAT = "fastckpt-records"
_MAX_SIDECAR = 64 << 20  # a sidecar is ~60 bytes per record: anything larger is not ours


def records_path(path: str) -> str:
    """The records sidecar of the torch file at ``path``: hidden (``.NAME.fastckpt-records``), so ``torch.load``,
    Lightning's ``*.ckpt`` listings and ``ls`` never see it."""
    folder, sep, name = path.rpartition("/")
    return f"{folder}{sep}.{name}{RECORDS_SUFFIX}"


def hash_staged(data: memoryview, entries: Any) -> list[list[Any]]:
    """Called by an I/O worker: ``[[table index, xxh3-128 hex], ...]`` of each staged record of a shard."""
    return [[e.index, xxhash.xxh3_128_hexdigest(data[e.offset:e.offset + e.nbytes])] for e in entries if e.nbytes]


def write_with_records(storage: Any, fmt: Any, views: dict[int, memoryview], crcs: dict[int, int],
                       results: Sequence[Any], source: Any) -> int:
    """Write the torch file ``fmt.path`` (a ``TorchFileFormat``) on an object store, by a part plan against the
    folder's newest ``.ckpt`` when ``source`` (the save's ``DedupSource``) is set; then its records sidecar.
    Returns the file's size."""
    hashed = {int(i): h for r in results if r[1].hashes for i, h in r[1].hashes}
    fixed = fmt.fixed(crcs)
    parts = _parts(fmt, fixed, views)
    size = fmt.layout.size
    records = tiling(fmt, fixed, hashed, size) if source is not None else None
    previous = folder_source(storage, fmt.path) if records else []
    side = records_path(fmt.path)
    storage.delete(side)  # the old file's records go before this file takes the name (a crash: no records)
    plan = plan_object(size, records, previous)
    if plan is None:
        storage.write_file_atomic(fmt.path, parts)  # an object store: appears whole, or not at all
        if source is not None:
            source.done(size, None)
    else:
        out = storage.write_planned(fmt.path, Joined(parts), plan)
        source.done(size, out)
        log.info("fastckpt: wrote %s: %.1f MB sent, %.1f MB copied server-side (%.1f MB fell back to sending)",
                 fmt.path, out.sent / 1e6, out.copied / 1e6, out.fell_back / 1e6)
    if records:
        write_records(storage, fmt.path, size, records)
    return size


def _parts(fmt: Any, fixed: list[tuple[int, bytearray]], views: dict[int, memoryview]) -> list[memoryview]:
    """The whole file as buffers (as ``TorchFileFormat.parts``, from fixed bytes already built)."""
    out: list[memoryview] = []
    for i, (_, gap) in enumerate(fixed):
        out.append(memoryview(gap))
        if i < len(fmt.layout.records) and fmt.layout.records[i].nbytes:
            out.append(views[i])
    return [p for p in out if len(p)]


def tiling(fmt: Any, fixed: list[tuple[int, bytearray]], hashed: dict[int, str], size: int) -> list[Record] | None:
    """Records tiling the torch file ``fmt``: each gap of fixed bytes (``fmt.fixed``), each staged record (``hashed``:
    table index -> hex, by the I/O workers). None when a record was not hashed (then the file is sent whole). With
    ``folder_source`` and ``objectdedup.plan_object``, what ranks sharing one object's upload plan with."""
    out = [Record(off, len(gap), xxhash.xxh3_128_hexdigest(gap)) for off, gap in fixed if len(gap)]
    for i, r in enumerate(fmt.layout.records):
        if r.nbytes:
            if i not in hashed:
                return None
            out.append(Record(r.offset, r.nbytes, hashed[i]))
    out.sort(key=lambda r: r.offset)
    at = 0
    for r in out:
        if r.offset != at:
            return None
        at += r.length
    return out if at == size else None


def write_records(storage: Any, path: str, size: int, records: list[Record]) -> None:
    """The new file's sidecar, naming the object by its size and the CRC32C the store keeps for it: a later file of
    the same name (written by anyone) no longer matches. No stored checksum: no sidecar (no identity to check)."""
    try:
        tag = storage.object_checksum(path)
        if tag is None:
            log.info("fastckpt: the store keeps no checksum of %s: no records sidecar, the next file is sent whole",
                     path)
            return
        doc = {"format": _FORMAT, "size": size, "crc32c": tag, FIELD: [list(r) for r in records]}
        storage.write_atomic(records_path(path), json.dumps(doc, separators=(",", ":")).encode())
    except (FastCkptError, FileNotFoundError) as e:  # the file is committed; only the next dedup is lost
        log.warning("fastckpt: could not write the records sidecar of %s (%s): the next file is sent whole", path, e)


def folder_source(storage: Any, path: str) -> list[SourceRecord]:
    """The records of the folder's newest torch file with a records sidecar (this very name's older file
    included), checked against the object; empty when there is none or it does not match."""
    folder = path.rpartition("/")[0]
    try:
        sides = [n for n in storage.listdir(folder) if n.startswith(".") and n.endswith(RECORDS_SUFFIX)]
        if not sides:
            return []
        newest = max(sides, key=lambda n: (storage.modified(storage.join(folder, n)), n))
        side = storage.join(folder, newest)
        obj = storage.join(folder, newest[1:-len(RECORDS_SUFFIX)])
        if storage.size(side) > _MAX_SIDECAR:  # planted: never read a huge object into memory
            raise IntegrityError(f"{side}: over {_MAX_SIDECAR} bytes, not a fastckpt records sidecar; delete it")
        data = storage.read_bytes(side)
        recs = parse_records(data, side)
        if storage.size(obj) != recs[0] or storage.object_checksum(obj) != recs[1]:
            log.info("fastckpt: %s no longer matches %s (replaced?): it is sent whole", side, obj)
            return []
    except (FastCkptError, FileNotFoundError) as e:
        log.info("fastckpt: no dedup source for %s (%s): it is sent whole", path, e)
        return []
    return [SourceRecord(obj, r.offset, r.length, r.digest) for r in recs[2]]


def parse_records(data: bytes, source: str) -> tuple[int, str, list[Record]]:
    """(size, stored checksum, records) of a sidecar; IntegrityError when it is not a well-formed one."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise IntegrityError(f"{source}: not valid JSON ({type(e).__name__}); delete it") from e
    if not (isinstance(doc, dict) and doc.get("format") == _FORMAT and type(doc.get("size")) is int
            and isinstance(doc.get("crc32c"), str)):
        raise IntegrityError(f"{source}: not a fastckpt records sidecar; delete it")
    recs = file_records(doc, doc["size"])
    if recs is None:
        raise IntegrityError(f"{source}: its records do not tile the {doc['size']}-byte file; delete it")
    return doc["size"], doc["crc32c"], recs
