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

from .errors import IntegrityError
from .plan import Shard, st_dtype

__all__ = [
    "FORMAT",
    "VERSION",
    "MANIFEST",
    "ALIGN",
    "FileRecord",
    "shard_header",
    "shard_file_name",
    "build_manifest",
    "parse_manifest",
    "parse_meta",
]

FORMAT = "fastckpt"
VERSION = 2  # the newest this code writes (only with DTensor blocks; see build_manifest) and reads
VERSIONS = tuple(range(1, VERSION + 1))
MANIFEST = "manifest.json"
ALIGN = 4096


@dataclass(slots=True)
class FileRecord:
    """A written file: its name inside the checkpoint directory, size and CRC32C."""

    name: str
    size: int
    crc32c: int


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
                   user: dict[str, Any] | None = None, version: int = 1) -> bytes:
    """The manifest JSON. ``files`` must list every file of the checkpoint, meta included."""
    doc = {
        "format": FORMAT,
        "version": version,
        "name": name,
        "step": step,
        "created": time.time(),
        "meta": meta_file,
        "nbytes": nbytes,
        "files": {f.name: {"size": f.size, "crc32c": f.crc32c} for f in files},
        "user": user or {},
    }
    return json.dumps(doc, indent=1).encode()


def parse_manifest(data: bytes, source: str) -> dict[str, Any]:
    """Parse and sanity-check a manifest; errors name ``source``."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{source}: manifest is not valid JSON ({e}); the file is corrupt or foreign") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise IntegrityError(f"{source}: not a fastckpt manifest (format field is {doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") not in VERSIONS:
        raise IntegrityError(f"{source}: manifest version {doc.get('version')!r} is not supported (this fastckpt "
                             f"reads {', '.join(map(str, VERSIONS))}); upgrade fastckpt")
    for field in ("name", "step", "meta", "files"):
        if field not in doc:
            raise IntegrityError(f"{source}: manifest lacks the {field!r} field")
    return doc


def parse_meta(data: bytes, source: str) -> dict[str, Any]:
    """Parse the meta file: ``tree``, ``tensors`` table, ``files`` order, ``objects``."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{source}: metadata is not valid JSON ({e})") from e
    if not isinstance(doc, dict) or "tree" not in doc or "tensors" not in doc:
        raise IntegrityError(f"{source}: not a fastckpt metadata file")
    return doc
