"""What a checkpoint's manifest and meta file say, parsed and checked: the commit record, read without torch.

``fastckpt list``, the catalogs and gc read manifests only; keeping this apart from the writer's layout
(``layout.py``: shard headers, which need torch's dtypes) lets them run without importing torch.
docs/FORMAT.md documents the fields.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..errors import IntegrityError
from .healthrecord import check_health
from .paths import plain_name

__all__ = ["CheckpointInfo", "FORMAT", "VERSION", "VERSIONS", "MANIFEST", "LAYOUT_FILES", "MAX_DEPTH",
           "checkpoint_dir", "parse_manifest", "parse_meta"]


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
# Deepest nesting a meta tree may have. Decoding recurses per level, so a crafted tree deeper than
# Python's recursion limit would raise RecursionError from deep inside the loader; real states are shallow.
MAX_DEPTH = 200
_CRC_LIMIT = 1 << 32


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
