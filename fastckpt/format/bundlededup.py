"""Dedup of a folder of framework files on an object store (Accelerate's ``checkpoint_N/`` on ``s3://``): each
member file's unchanged ranges are copied server-side from the previous committed folder instead of sent.

Every ``save_state`` is a new folder, so a copy source beside the file (the ``.NAME.fastckpt-records`` sidecar of a
Lightning ``.ckpt``, ``torchrecords.py``) would never be found, and a sidecar must not go into a folder that holds
stock Accelerate's files only. The records therefore go where fastckpt already writes, last, for every such
folder: its ``manifest.json`` lists each member's content records (``"xxh3_128"``, as the core layout's shards
do; readers that do not know the field ignore it). The copy source of the next folder is found by the root's
``DirectDedup`` (``engine/dedupwrite.py``): the folder this process committed last, or for a resumed run the
newest one whose manifest reads back. So the next ``checkpoint_N`` copies from ``checkpoint_{N-1}``.

Each member is hashed from the very bytes it is written from (the header or pickle and zip bytes, then each staged
tensor: one record per buffer), on the I/O worker that writes it. The older folder is never depended on: every
copied part's CRC32C is checked against the local bytes (``storage/s3copy.py``), so a source deleted by retention
(``total_limit``), replaced, or a manifest whose records lie, costs only bytes (those parts are sent).

A local folder that the remote tier uploads (``remote.url`` on ``s3://``, ``remote.dedup``) lists the same records
(``upload_records``): the upload copies each member's unchanged ranges from the previous uploaded folder
(``tiers/dedup.py``), by the manifest it uploads, so nothing but ``manifest.json`` is added there either.
"""
from __future__ import annotations

from typing import Any, Sequence

import xxhash

from .objectdedup import as_records, copies_ranges, write_deduped

__all__ = ["hash_parts", "upload_records", "write_member"]


def hash_parts(parts: Sequence[memoryview]) -> list[list[Any]]:
    """``[[offset, length, xxh3-128 hex], ...]``: one record per non-empty buffer, tiling the file they make."""
    out: list[list[Any]] = []
    at = 0
    for p in parts:
        if len(p):
            out.append([at, len(p), xxhash.xxh3_128_hexdigest(p)])
            at += len(p)
    return out


def write_member(storage: Any, path: str, parts: Sequence[memoryview], source: Any) -> list[list[Any]] | None:
    """Write one member by a part plan against ``source`` (the save's ``DedupSource``) where the store copies
    ranges. Returns its records for the manifest (None: no dedup here, the caller writes the file as usual), after
    the file was written; when no plan applies (no previous folder, nothing in common) it is written whole here."""
    if source is None or not copies_ranges(storage):
        return None
    records = hash_parts(parts)
    if not write_deduped(storage, path, parts, as_records(records), source):
        storage.write_file_atomic(path, list(parts))  # an object store: appears whole, or not at all
    return records


def upload_records(parts: Sequence[memoryview], source: Any) -> list[list[Any]] | None:
    """The records of a member written to a local root whose commits the remote tier uploads with dedup (the save's
    source says so: ``DirectDedup.upload_records``), for its manifest; None elsewhere (nothing hashed)."""
    if source is None or not getattr(source, "upload_records", False):
        return None
    return hash_parts(parts)
