"""Shards of a local root written as reflink clones of the previous checkpoint's (``persist.reflink``).

A shard with the same layout as a shard of the newest committed checkpoint of the root (same record offsets and
lengths: the same tensors, shapes and dtypes) and at least half its bytes unchanged (same xxh3-128 content record:
a frozen part of the model) is cloned from that file (``storage/reflink.py``: ``FICLONE``, the file system shares
its extents, no data is written), then its header (it carries the step, so it always differs) and its changed
tensors are written over the clone (copy on write: only those blocks are new) and the file is fsynced like any
shard. The clone is an independent file: deleting the older checkpoint changes nothing in this one. A shard whose
layout changed, or mostly changed, is written in full.

The records compared are the ones the I/O worker hashed from the staged bytes and the ones the older manifest
lists. When every tensor is unchanged, the older file's CRC32C as its manifest lists it must also be that of its
header (read back: one page) followed by the staged bytes. The source's tensor bytes are not read back (that
would cost what the clone saves): the clone's file record (size, CRC32C) is computed from the staged bytes as for
a written shard, so a source whose bytes changed on disk after its commit fails the CRC check on load, never a
silent wrong answer (btrfs also checksums its data blocks).
"""
from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

from ..storage.partplan import Record, SourceRecord
from ..storage.reflink import clone_patched
from .checksum import combine, crc32c

__all__ = ["CloneSource", "clone_plan", "write_cloned"]

log = logging.getLogger("fastckpt")


class CloneSource(Protocol):
    """The newest committed checkpoint of a local root whose file system can clone (``engine/dedupwrite.py``)."""

    clones: bool
    fsync: bool

    def previous(self) -> list[SourceRecord]:
        """The records of the copy source, each naming its file's path; empty when there is none."""

    def listed_crc(self, path: str) -> int | None:
        """The CRC32C the copy source's manifest lists for its file ``path``, or None."""

    def cloned(self, size: int, written: int) -> None:
        """One shard of ``size`` bytes made by a clone, of which ``written`` bytes (header, changes) were written."""


def clone_plan(records: Sequence[Record], previous: Sequence[SourceRecord]) -> tuple[str, list[Record]] | None:
    """The previous file to clone for a file of ``records``: one with the same layout (record offsets and lengths)
    holding at least half its bytes unchanged (same hash), and the records to write over the clone (the header,
    then the changed ones); None when no file qualifies (then writing the staged bytes is as good). Pure."""
    if len(records) < 2:
        return None
    layout = [(r.offset, r.length) for r in records]
    size = sum(r.length for r in records)
    by_file: dict[str, list[SourceRecord]] = {}
    for s in previous:
        by_file.setdefault(s.key, []).append(s)
    best: tuple[int, str, list[Record]] | None = None
    for key, recs in by_file.items():
        if [(s.offset, s.length) for s in recs] != layout:
            continue
        changed = [records[0]] + [r for r, old in zip(records[1:], recs[1:]) if r.digest != old.digest]
        shared = size - sum(r.length for r in changed)
        if 2 * shared >= size and (best is None or shared > best[0]):
            best = (shared, key, changed)
    return None if best is None else (best[1], best[2])


def write_cloned(path: str, head: bytes | memoryview, data: memoryview, data_crc: int,
                 records: Sequence[Record] | None, source: Any) -> bool:
    """Write the shard at ``path`` (``head``, then the staged ``data`` whose CRC32C is ``data_crc``) as a clone of
    a previous checkpoint's shard with the same layout, then its header and changed ranges over it; False when
    there is none or it cannot be cloned (the caller writes the shard as usual)."""
    if source is None or not getattr(source, "clones", False) or not records:
        return False
    plan = clone_plan(records, source.previous())
    if plan is None:
        return False
    src, changed = plan
    listed = source.listed_crc(src)

    def same_bytes(old_head: bytes) -> bool:
        # all tensors unchanged: the CRC32C its manifest lists for the source file must be that of its header
        # followed by our staged bytes, a second, independent check of the xxh3 records (hostile or mistaken
        # records are not trusted). Some changed: the old bytes of those are unknown here, the records decide.
        if len(changed) > 1:
            return True
        return listed is not None and combine(crc32c(old_head), data_crc, len(data)) == listed

    hlen = len(head)
    patches = [(0, memoryview(head))] + [(r.offset, data[r.offset - hlen: r.offset - hlen + r.length])
                                         for r in changed[1:]]
    size = hlen + len(data)
    if not clone_patched(src, path, patches, size, source.fsync, same_bytes):
        return False
    written = sum(len(p) for _, p in patches)
    source.cloned(size, written)
    log.debug("fastckpt: %s cloned from %s (%d bytes shared, %d written)", path, src, size - written, written)
    return True
