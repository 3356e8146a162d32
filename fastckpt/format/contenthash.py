"""Content records of a file: byte ranges tiling it, each with a strong hash (xxh3-128), so the next upload can
copy unchanged ranges server-side instead of sending them (``storage/partplan.py``).

The I/O worker that writes a shard hashes it from the staged bytes it is writing (never the training thread):
the header is one record, then each tensor with the padding up to the next one. The manifest lists them per file
(``"xxh3_128": [[offset, length, hex], ...]``); readers that do not know the field ignore it, so every file stays
a stock safetensors file. A manifest read back is hostile input: records that do not tile the file with
well-formed hashes are dropped (that file is then uploaded whole), never trusted into a wrong copy.
"""
from __future__ import annotations

from typing import Any, Sequence

import xxhash

from ..storage.partplan import Record

__all__ = ["FIELD", "file_records", "hash_records"]

FIELD = "xxh3_128"  # the manifest field of a file's records; its name is the hash
_HEX = frozenset("0123456789abcdef")


def hash_records(header: bytes | memoryview, data: memoryview, starts: Sequence[int]) -> list[list[Any]]:
    """Records of a file made of ``header`` then ``data``: the header, then ``data`` cut at ``starts`` (offsets
    into ``data``, the tensors'), each range running to the next start, the last to the end."""
    out: list[list[Any]] = [[0, len(header), xxhash.xxh3_128_hexdigest(header)]]
    base = len(header)
    edges = sorted({0, *(s for s in starts if 0 <= s < len(data))}) + [len(data)]
    for a, b in zip(edges, edges[1:]):
        if b > a:
            out.append([base + a, b - a, xxhash.xxh3_128_hexdigest(data[a:b])])
    return out


def file_records(rec: Any, size: int) -> list[Record] | None:
    """The records of one manifest file entry (``rec``: its dict), checked to tile its ``size`` bytes in order
    with 32-digit lowercase hex hashes; None when absent or malformed (the file is then sent whole)."""
    raw = rec.get(FIELD) if isinstance(rec, dict) else None
    if not isinstance(raw, list):
        return None
    out: list[Record] = []
    at = 0
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and type(item[0]) is int and type(item[1]) is int
                and isinstance(item[2], str) and len(item[2]) == 32 and _HEX.issuperset(item[2])):
            return None
        if item[0] != at or item[1] <= 0:
            return None
        out.append(Record(item[0], item[1], item[2]))
        at += item[1]
    return out if at == size else None
