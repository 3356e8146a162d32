"""Shards of a local root written as reflink clones of the previous checkpoint's (``persist.reflink``).

A shard whose tensor bytes are all unchanged since the newest committed checkpoint of the root (a frozen part of
the model: same length, same xxh3-128 content records after the header) is cloned from that checkpoint's shard
(``storage/reflink.py``: the file system shares its extents, no data is written), then its header is written over
the clone's (the header carries the step, so it always differs) and the file is fsynced like any shard. The
clone is an independent file: deleting the older checkpoint changes nothing in this one.

Only whole shards are cloned: a shard with any changed tensor is written in full (ranges are not cloned).
The records compared are the ones the I/O worker hashed from the staged bytes and the ones the older manifest
lists; then the older file's CRC32C and size as its manifest lists them must be those of its header (read back:
one page) followed by the staged bytes. The source's tensor bytes are not read back (that would cost what the
clone saves): the clone's file record (size, CRC32C) is computed from the staged bytes as for a written shard, so
a source whose bytes changed on disk after its commit fails the CRC check on load, never a silent wrong answer
(btrfs also checksums its data blocks).
"""
from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

from ..storage.partplan import Record, SourceRecord
from ..storage.reflink import clone_with_head
from .checksum import combine, crc32c

__all__ = ["CloneSource", "clone_source_of", "write_cloned"]

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
        """One shard of ``size`` bytes made by a clone, of which ``written`` bytes (its header) were written."""


def clone_source_of(records: Sequence[Record], previous: Sequence[SourceRecord]) -> str | None:
    """The path of a previous file whose records equal ``records`` after the header (the first record), with a
    header of the same length; None when no file matches. Pure."""
    if len(records) < 2:
        return None
    want = [(r.offset, r.length, r.digest) for r in records]
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for s in previous:
        by_file.setdefault(s.key, []).append((s.offset, s.length, s.digest))
    for key, recs in by_file.items():
        if len(recs) == len(want) and recs[0][:2] == want[0][:2] and recs[1:] == want[1:]:
            return key
    return None


def write_cloned(path: str, head: bytes | memoryview, data: tuple[int, int], records: Sequence[Record] | None,
                 source: Any) -> bool:
    """Write the shard at ``path`` (``head``, then ``data``: the staged bytes' length and CRC32C) as a clone of
    the previous checkpoint's identical shard, then ``head`` over its header; False when there is none or it
    cannot be cloned (the caller writes the shard as usual)."""
    if source is None or not getattr(source, "clones", False) or not records:
        return False
    src = clone_source_of(records, source.previous())
    if src is None:
        return False
    data_len, data_crc = data
    listed = source.listed_crc(src)

    def same_bytes(old_head: bytes) -> bool:
        # the CRC32C its manifest lists for the source file must be that of its header followed by our staged
        # bytes: a second, independent check of the xxh3 records (hostile or mistaken records are not trusted)
        return listed is not None and combine(crc32c(old_head), data_crc, data_len) == listed

    size = len(head) + data_len
    if not clone_with_head(src, path, head, size, source.fsync, same_bytes):
        return False
    source.cloned(size, len(head))
    log.debug("fastckpt: %s cloned from %s (%d bytes shared, header written)", path, src, size - len(head))
    return True
