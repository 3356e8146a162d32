"""Where the content records of a torch or safetensors file uploaded to an object store live, and so where the next
file of the same name finds its copy source (``objectdedup.py``): beside the file, or under the root.

A file straight in the root (Lightning's ``.ckpt`` in its dirpath) keeps them in its hidden sidecar
``.NAME.fastckpt-records`` (``torchrecords.py``), and the next file plans against the folder's newest sidecar. A file
in a folder of the root (``save_file(..., "checkpoint_N/model.safetensors")``: Accelerate's big files, uploaded by
every process) is in a new folder at every save, which must hold stock Accelerate's files only: its records go to
``<root>/.fastckpt/records/NAME.json``, naming the object they describe, so the next ``checkpoint_{N+1}/NAME``
copies from ``checkpoint_N/NAME``. As with a sidecar, the object's size and the CRC32C the store keeps must still
match (else nothing is copied), and every copied part is checked against the local bytes (``storage/s3copy.py``,
``engine/shareddedup.py``): a stale or forged record costs bytes, never a wrong file. The older object may go at any
time (retention): its copies then fail over to sending.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from ..errors import FastCkptError, IntegrityError
from ..storage.partplan import Record, SourceRecord
from .contenthash import FIELD, file_records
from .paths import is_plain_name
from .torchrecords import folder_source, records_path, write_records

__all__ = ["at_root", "drop_records", "root_records_path", "save_records", "source_records"]

log = logging.getLogger("fastckpt")

_FORMAT = "fastckpt-root-records"
_MAX = 64 << 20  # ~60 bytes per record: anything larger is not ours


def at_root(storage: Any, path: str) -> bool:
    """Whether ``path`` is in a folder of ``storage``'s root (its records then live under the root)."""
    root = storage.url.rstrip("/") + "/"
    return path.startswith(root) and "/" in path[len(root):]


def root_records_path(storage: Any, path: str) -> str:
    """``<root>/.fastckpt/records/NAME.json``: the records of the newest file named ``NAME`` in a folder of the root."""
    name = path.rpartition("/")[2]
    return f"{storage.url.rstrip('/')}/.fastckpt/records/{name}.json"


def source_records(storage: Any, path: str) -> list[SourceRecord]:
    """The copy source of the file about to be written at ``path`` (empty: none, or it no longer matches)."""
    if not at_root(storage, path):
        return folder_source(storage, path)
    where = root_records_path(storage, path)
    try:
        if storage.size(where) > _MAX:  # planted: never read a huge object into memory
            raise IntegrityError(f"{where}: over {_MAX} bytes, not fastckpt's content records; delete it")
        obj, size, tag, recs = _parse(storage.read_bytes(where), where, storage)
        if obj == path:
            return []  # the very name being replaced: its old bytes may be overwritten while they are copied
        if storage.size(obj) != size or storage.object_checksum(obj) != tag:
            log.info("fastckpt: %s no longer matches %s (replaced?): %s is sent whole", where, obj, path)
            return []
    except (FastCkptError, FileNotFoundError) as e:
        log.info("fastckpt: no dedup source for %s (%s): it is sent whole", path, e)
        return []
    return [SourceRecord(obj, r.offset, r.length, r.digest) for r in recs]


def drop_records(storage: Any, path: str) -> None:
    """Before ``path`` is replaced: a sidecar beside it goes (it would describe the old bytes). Records under the
    root name their object and stay valid until it changes: nothing to drop."""
    if not at_root(storage, path):
        storage.delete(records_path(path))


def save_records(storage: Any, path: str, size: int, records: list[Record]) -> None:
    """After ``path`` was committed: its records, where the next file of its name looks for them."""
    if not at_root(storage, path):
        write_records(storage, path, size, records)
        return
    try:
        tag = storage.object_checksum(path)
        if tag is None:
            log.info("fastckpt: the store keeps no checksum of %s: no records, the next file is sent whole", path)
            return
        doc = {"format": _FORMAT, "object": path, "size": size, "crc32c": tag, FIELD: [list(r) for r in records]}
        storage.write_atomic(root_records_path(storage, path), json.dumps(doc, separators=(",", ":")).encode())
    except (FastCkptError, FileNotFoundError) as e:  # the file is committed; only the next dedup is lost
        log.warning("fastckpt: could not write the content records of %s (%s): the next file is sent whole", path, e)


def _parse(data: bytes, where: str, storage: Any) -> tuple[str, int, str, list[Record]]:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise IntegrityError(f"{where}: not valid JSON ({type(e).__name__}); delete it") from e
    if not (isinstance(doc, dict) and doc.get("format") == _FORMAT and type(doc.get("size")) is int
            and isinstance(doc.get("crc32c"), str) and isinstance(doc.get("object"), str)):
        raise IntegrityError(f"{where}: not fastckpt's content records; delete it")
    obj = doc["object"]
    root = storage.url.rstrip("/") + "/"
    rest = obj[len(root):].split("/") if obj.startswith(root) else []
    if len(rest) != 2 or not all(is_plain_name(p) for p in rest):
        raise IntegrityError(f"{where}: names {obj!r:.200}, not a file in a folder of {storage.url}; delete it")
    recs = file_records(doc, doc["size"])
    if recs is None:
        raise IntegrityError(f"{where}: its records do not tile the {doc['size']}-byte file; delete it")
    return obj, doc["size"], doc["crc32c"], recs
