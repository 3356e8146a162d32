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
overwrites bytes the current manifest still points to. Parsing the manifest and the meta file lives in
``manifest.py`` (no torch there); its names are re-exported here.
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
from .manifest import (FORMAT, LAYOUT_FILES, MANIFEST, MAX_DEPTH, VERSION, CheckpointInfo, checkpoint_dir,
                       parse_manifest, parse_meta)
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

ALIGN = 4096


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
    # one line: the json module's C encoder; an indent would run its pure-Python one, about 25,000 calls on the
    # commit thread for a 600-tensor manifest with health (each a GIL hold the training thread may wait behind)
    return json.dumps(doc).encode()


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


