"""Dedup of files written straight to an object store: each file is uploaded by a part plan against a previous
committed object's content records, so its unchanged ranges are copied server-side instead of sent.

Two writers use it: a shard of the open layout on a direct ``s3://`` root (``openlayout.py``; the copy source is
the newest committed checkpoint of the root, ``engine/dedupwrite.py``) and a torch file (``torchrecords.py``; the
copy source is the newest ``.ckpt`` of its folder, found by its records sidecar). ``plan_object`` is the seam for
multi-rank uploads of one object: a pure function of the new records and the previous ones. Every object stays a
complete, stock-readable file (``storage/s3copy.py`` checks each copied part's CRC32C against the local bytes and
sends what does not match), so deleting the copy source later changes nothing.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

from ..errors import IntegrityError
from ..storage.joined import Joined
from ..storage.partplan import MIN_PART, Part, Record, SourceRecord, plan_parts
from ..storage.s3copy import CopyOutcome

__all__ = ["DedupSource", "as_records", "copies_ranges", "plan_object", "write_deduped"]

log = logging.getLogger("fastckpt")


class DedupSource(Protocol):
    """Where a writer finds the copy source of its files, and reports what each planned write did."""

    def previous(self) -> list[SourceRecord]:
        """The records of the copy source (each naming its object's URL); empty when there is none."""

    def done(self, size: int, outcome: CopyOutcome | None) -> None:
        """One file written: by a plan (``outcome``), or sent whole (None)."""


def copies_ranges(storage: Any) -> bool:
    """Whether ``storage`` can copy ranges of its objects server-side (S3's ``UploadPartCopy``)."""
    return bool(getattr(storage, "copies_ranges", False)) and hasattr(storage, "write_planned")


def plan_object(size: int, records: Sequence[Record] | None, previous: Sequence[SourceRecord]) -> list[Part] | None:
    """The part plan of one ``size``-byte object from its content ``records`` and a previous object's, or None
    when nothing in it can be copied (then it is sent as without dedup). Pure: ranks sharing one object's upload
    can each execute their share of the same plan."""
    if not records or not previous or size < MIN_PART:
        return None
    try:
        parts = plan_parts(size, records, previous)
    except IntegrityError as e:  # records from a hostile manifest or sidecar: sent whole, never a wrong copy
        log.warning("fastckpt: %s", e)
        return None
    return parts if any(p.kind == "copy" for p in parts) else None


def write_deduped(storage: Any, path: str, parts: Sequence[memoryview], records: Sequence[Record] | None,
                  source: DedupSource | None) -> bool:
    """Write ``parts`` (one file) to ``path`` by a part plan against ``source``'s records; False when no plan
    applies (the caller writes the file as usual). The records were hashed by the caller from these very bytes."""
    if source is None or not records or not copies_ranges(storage):
        return False
    size = sum(len(p) for p in parts)
    plan = plan_object(size, records, source.previous())
    if plan is None:
        source.done(size, None)
        return False
    out = storage.write_planned(path, Joined(parts), plan)
    source.done(size, out)
    log.info("fastckpt: wrote %s: %.1f MB sent, %.1f MB copied server-side (%.1f MB fell back to sending)", path,
             out.sent / 1e6, out.copied / 1e6, out.fell_back / 1e6)
    return True


def as_records(raw: Sequence[Sequence[Any]]) -> list[Record]:
    """``[[offset, length, hex], ...]`` (as the writers build them) as ``Record``s."""
    return [Record(int(o), int(n), str(h)) for o, n, h in raw]
