"""A fast reader of torch checkpoint files (the zip ``torch.save`` writes; Lightning's ``.ckpt``).

``torch.load`` reads the records one after another on one thread, copying each into a fresh storage,
and a CRC-32 check of the file (``fastckpt.torchfile.verify_torch_file``) is a second pass over it.
Here every storage record is read once, in parallel pieces (``fastckpt.readers``), into one
page-aligned buffer laid out like the file; each record's CRC-32 is checked against its zip entry by
the thread that completed it; then torch's own loader unpickles ``data.pkl`` (with its
``weights_only`` unpickler) over that buffer, as ``torch.load(mmap=True)`` does over a mapping, so
the storages are views of the read buffer: no second copy.
"""
from __future__ import annotations

import os
import zlib
from typing import Any

import torch

from .errors import IntegrityError
from .readers import Range, read_ranges
from .storage import LocalStorage, aligned_buffer
from .torchfile import record_spans

__all__ = ["load_torch_file"]

try:  # the same CRC-32 torchfile uses (zlib-ng is faster where installed); both release the GIL
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32


def load_torch_file(path: str, *, map_location: Any = None, workers: int = 4, verify: bool = True) -> Any:
    """``torch.load(path, map_location=map_location, weights_only=True)``, read in parallel and verified."""
    spans = record_spans(path)
    keep, view = aligned_buffer(os.path.getsize(path))
    want: dict[int, tuple[str, int]] = {}
    ranges = []
    for name, offset, size, crc in spans:
        if not name.startswith("data/"):
            continue  # data.pkl, byteorder, version: torch's reader reads those few bytes itself
        r = Range(path, offset, view[offset:offset + size])
        ranges.append(r)
        if verify and (crc or not size):
            want[id(r)] = (name, crc)

    def check(r: Range) -> None:
        name, crc = want.get(id(r), ("", None))
        if crc is not None and _crc32(r.out) & 0xFFFFFFFF != crc:
            raise IntegrityError(f"{path}: record {name!r} has CRC-32 {_crc32(r.out) & 0xFFFFFFFF:08x}, its zip "
                                 f"entry says {crc:08x}; the checkpoint is damaged: resume from an earlier one")

    read_ranges(LocalStorage(os.path.dirname(path) or "."), ranges, workers, check)
    overall = torch.frombuffer(keep, dtype=torch.uint8).untyped_storage()  # keeps ``keep`` alive
    reader = torch._C.PyTorchFileReader(path)
    # torch.load(mmap=True)'s own path, with the read buffer standing in for the mapping
    return torch.serialization._load(reader, map_location, torch._weights_only_unpickler,
                                     overall_storage=overall, encoding="utf-8")
