"""The on-disk layout (documented in docs/FORMAT.md).

A checkpoint is a directory ``<root>/<name>/`` holding:

* ``shard-NNNNN.<uid>.safetensors``: tensor data; the header is padded with spaces
  (allowed by the safetensors spec) so that the data section starts on a 4 KiB
  boundary and can be written straight from page-aligned host buffers with O_DIRECT;
* ``meta.<uid>.json``: the tree (structure and plain leaves) and the tensor table;
* ``objects.<uid>.pt``: optional, non-plain leaves for torch's weights_only loader;
* ``manifest.json``: written last; lists every file with its size and CRC32C. Its
  presence is the commit. Version 2 marks a checkpoint holding DTensor blocks
  (``dtensors`` in the meta file), which a version-1 reader must not load as
  plain tensors; every other checkpoint is version 1.

File names carry a per-save ``uid`` so that re-saving under the same name never
overwrites bytes the current manifest still points to.
"""
from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import IntegrityError
from .contenthash import FIELD
from .health import check_health
from .paths import plain_name
from .plan import Shard
from .safetensorsfile import st_dtype

__all__ = [
    "CheckpointInfo",
    "FORMAT",
    "VERSION",
    "MANIFEST",
    "LAYOUT_FILES",
    "ALIGN",
    "FileRecord",
    "shard_header",
    "shard_file_name",
    "build_manifest",
    "parse_manifest",
    "parse_meta",
    "checkpoint_dir",
    "check_shard_header",
    "MAX_DEPTH",
]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint."""

    name: str
    step: int
    path: str
    nbytes: int
    healthy: bool | None = None  # its health record's verdict (format/health.py); None: not measured
    crc32c: int | None = None  # a file shared by the ranks, on rank 0 where known: its CRC32C (engine/sharedobject.py)

FORMAT = "fastckpt"
VERSION = 2  # the newest this code writes (only with DTensor blocks; see build_manifest) and reads
VERSIONS = tuple(range(1, VERSION + 1))
MANIFEST = "manifest.json"
LAYOUT_FILES = "files"  # a manifest of a framework's own files (fastckpt.format.bundle): no meta file, no tensor table
ALIGN = 4096
# Deepest nesting a meta tree may have. Decoding recurses per level, so a crafted tree deeper than
# Python's recursion limit would raise RecursionError from deep inside the loader; real states are shallow.
MAX_DEPTH = 200
_CRC_LIMIT = 1 << 32


@dataclass(slots=True)
class FileRecord:
    """A written file: its name inside the checkpoint directory, size and CRC32C."""

    name: str
    size: int
    crc32c: int
    hashes: list[list[Any]] | None = None  # content records (contenthash.py): [offset, length, xxh3-128 hex]


def shard_file_name(index: int, uid: str) -> str:
    return f"shard-{index:05d}.{uid}.safetensors"


def shard_header(shard: Shard, step: int, keys: list[str]) -> bytes:
    """The 8-byte length plus JSON header, space-padded to a multiple of ``ALIGN``."""
    header: dict[str, Any] = {}
    real_dtypes: dict[str, str] = {}
    for e in shard.entries:
        sd = st_dtype(e.dtype)
        shape = list(e.shape)
        if sd == "U8" and e.dtype != torch.uint8:  # no safetensors name: raw bytes
            shape = [e.nbytes]
            real_dtypes[keys[e.index]] = str(e.dtype).removeprefix("torch.")
        header[keys[e.index]] = {"dtype": sd, "shape": shape, "data_offsets": [e.offset, e.offset + e.nbytes]}
    meta = {"format": "pt", "producer": FORMAT, "step": str(step)}
    if real_dtypes:
        meta["fastckpt.raw_dtypes"] = json.dumps(real_dtypes)
    header["__metadata__"] = meta
    body = json.dumps(header, separators=(",", ":")).encode()
    total = -(-(8 + len(body)) // ALIGN) * ALIGN
    body += b" " * (total - 8 - len(body))
    return struct.pack("<Q", len(body)) + body


def build_manifest(name: str, step: int, files: list[FileRecord], meta_file: str, nbytes: int,
                   user: dict[str, Any] | None = None, version: int = 1,
                   health: dict[str, Any] | None = None) -> bytes:
    """The manifest JSON. ``files`` must list every file of the checkpoint, meta included."""
    doc = {
        "format": FORMAT,
        "version": version,
        "name": name,
        "step": step,
        "created": time.time(),
        "meta": meta_file,
        "nbytes": nbytes,
        "files": {f.name: {"size": f.size, "crc32c": f.crc32c, **({FIELD: f.hashes} if f.hashes else {})}
                  for f in files},
        "user": user or {},
    }
    if health is not None:  # optional: older readers ignore it, older manifests lack it
        doc["health"] = health
    return json.dumps(doc, indent=1).encode()


def check_shard_header(head: bytes, size: int, first: int | None, source: str) -> None:
    """A shard's 8-byte safetensors header length must fit the file and end before its first tensor.

    ``head`` is the file's first bytes, ``size`` its length, ``first`` the offset of its first tensor
    by the tensor table (None if it holds none).
    """
    start = 8 + struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else None
    if start is None or start > size or (first is not None and first < start):
        raise IntegrityError(f"{source}: the safetensors header (ending at byte {start}) does not fit the file "
                             f"({size} bytes) or covers tensor data (first tensor at byte {first}); the file is "
                             "corrupt or crafted")


def checkpoint_dir(path: str) -> str:
    """The checkpoint directory a user path names: the directory itself, or its ``manifest.json``."""
    path = path.rstrip("/")
    return path[: -len(MANIFEST) - 1] if path.endswith("/" + MANIFEST) else path


def _json(data: bytes, source: str, what: str) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        # RecursionError: deeply nested JSON ("[[[[..."); the C decoder recurses per level.
        raise IntegrityError(f"{source}: {what} is not valid JSON ({type(e).__name__}: {str(e)[:200]}); the file "
                             "is corrupt or foreign: restore it from a good copy or delete the checkpoint") from e


def _count(value: Any, field: str, source: str, limit: int | None = None) -> int:
    """``value`` as a non-negative int (not a bool, not a string), below ``limit``; else IntegrityError."""
    if type(value) is not int or value < 0 or (limit is not None and value >= limit):
        raise IntegrityError(f"{source}: field {field!r} is {value!r:.80}, not a non-negative integer"
                             + (f" below {limit}" if limit is not None else "") + "; the file is corrupt or foreign")
    return value


def parse_manifest(data: bytes, source: str) -> dict[str, Any]:
    """Parse and validate a manifest; errors name ``source`` and the field.

    Every field a caller uses is checked here, once: ``step``/``nbytes`` are integers, each listed file
    is a plain name (callers join them to the checkpoint directory to read, upload and *delete* them)
    with an integer size and CRC32C, and ``meta`` is one of the listed files.
    """
    doc = _json(data, source, "manifest")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise IntegrityError(f"{source}: not a fastckpt manifest (format field is {found!r:.80})")
    if doc.get("version") not in VERSIONS or type(doc.get("version")) is not int:
        raise IntegrityError(f"{source}: manifest version {doc.get('version')!r:.80} is not supported (this fastckpt "
                             f"reads {', '.join(map(str, VERSIONS))}); upgrade fastckpt")
    files_layout = doc.get("layout") == LAYOUT_FILES
    for field in ("name", "step", "files") if files_layout else ("name", "step", "meta", "files"):
        if field not in doc:
            raise IntegrityError(f"{source}: manifest lacks the {field!r} field")
    if not isinstance(doc["name"], str):
        raise IntegrityError(f"{source}: field 'name' is {doc['name']!r:.80}, not a string")
    _count(doc["step"], "step", source)
    _count(doc.get("nbytes", 0), "nbytes", source)
    if not isinstance(doc["files"], dict) or not isinstance(doc.get("user", {}), dict):
        raise IntegrityError(f"{source}: fields 'files' and 'user' must be JSON objects; the file is corrupt "
                             "or foreign")
    for name, rec in doc["files"].items():
        plain_name(name, "listed file", source)
        if not isinstance(rec, dict):
            raise IntegrityError(f"{source}: the record of file {name!r} is {rec!r:.80}, not an object")
        _count(rec.get("size"), f"files.{name}.size", source)
        _count(rec.get("crc32c"), f"files.{name}.crc32c", source, _CRC_LIMIT)
    if "health" in doc:
        check_health(doc["health"], source)
    if files_layout:
        return doc
    plain_name(doc["meta"], "meta file", source)
    if doc["meta"] not in doc["files"]:
        raise IntegrityError(f"{source}: the meta file {doc['meta']!r} is not among the listed files")
    return doc


def parse_meta(data: bytes, source: str) -> dict[str, Any]:
    """Parse the meta file: ``tree``, ``tensors`` table, ``files`` order, ``objects``.

    The tensor table itself is checked against the manifest by ``fastckpt.format.table``.
    """
    doc = _json(data, source, "metadata")
    if not isinstance(doc, dict) or "tree" not in doc or not isinstance(doc.get("tensors"), list):
        raise IntegrityError(f"{source}: not a fastckpt metadata file (it needs a 'tree' and a 'tensors' list)")
    if doc.get("objects") is not None:
        plain_name(doc["objects"], "objects file", source)
    if not isinstance(doc.get("dtensors") or [], list):
        raise IntegrityError(f"{source}: field 'dtensors' is not a list")
    if _depth(doc["tree"]) > MAX_DEPTH:
        raise IntegrityError(f"{source}: the tree is nested deeper than {MAX_DEPTH} levels; the file is crafted "
                             "or foreign")
    return doc


def _depth(node: Any) -> int:
    """Nesting depth of a JSON value, iteratively (a recursive walk is what a deep tree would break)."""
    deepest, todo = 0, [(node, 1)]
    while todo:
        node, level = todo.pop()
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            break
        if isinstance(node, dict):
            todo.extend((v, level + 1) for v in node.values())
        elif isinstance(node, list):
            todo.extend((v, level + 1) for v in node)
    return deepest
