"""Unchanged bytes are never re-sent: the remote tier's dedup against the newest committed remote checkpoint.

Each shard file's manifest entry lists content records (``format/contenthash.py``). Before an upload, the newest
checkpoint the remote catalog holds (the previous save of the run; the same name's older copy counts too, since
its files are deleted only after the new manifest commits) gives the records it already stores. Each file to
upload gets a part plan (``storage/partplan.py``): the ranges the previous checkpoint holds are copied
server-side, the rest sent. Every object is complete on its own, so retention may delete the previous checkpoint
at any time afterwards; a source deleted before its copy is sent instead (``storage/s3copy.py``).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from .catalog import Catalog
from ..errors import FastCkptError, IntegrityError
from ..format.contenthash import file_records
from ..format.layout import MANIFEST, parse_manifest
from ..storage.partplan import MIN_PART, Part, Record, SourceRecord, plan_parts
from ..storage.protocol import Storage
from ..storage.s3copy import CopyOutcome

__all__ = ["DedupStats", "plan_for", "previous_records", "records_of"]

log = logging.getLogger("fastckpt")


@dataclass
class DedupStats:
    """Per remote tier, over all its uploads: the bytes that went over the network and those the store copied."""

    sent: int = 0  # bytes sent (whole files and the sent parts of planned ones)
    copied: int = 0  # bytes the store copied from the previous checkpoint instead
    fell_back: int = 0  # bytes planned as copies but sent (the source was gone, or its checksum differed)
    unverified_copies: int = 0  # copied parts the store returned no checksum for (verified by nothing but it)
    planned_files: int = 0  # files uploaded by a plan with copies
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def whole(self, size: int) -> None:
        with self._lock:
            self.sent += size

    def planned(self, out: CopyOutcome) -> None:
        with self._lock:
            self.sent += out.sent
            self.copied += out.copied
            self.fell_back += out.fell_back
            self.unverified_copies += out.unverified
            self.planned_files += 1


def records_of(doc: dict) -> dict[str, list[Record]]:
    """The content records of each file of a parsed manifest that has well-formed ones."""
    out = {}
    for name, rec in doc["files"].items():
        recs = file_records(rec, int(rec["size"]))
        if recs:
            out[name] = recs
    return out


def previous_records(remote: Storage, catalog: Catalog) -> list[SourceRecord]:
    """The records of the newest committed remote checkpoint, each naming its object's URL; empty when there is
    none or it cannot be read (then every file is sent whole, as without dedup)."""
    try:
        infos = catalog.list()
        if not infos:
            return []
        prev = infos[-1]
        mpath = remote.join(prev.path, MANIFEST)
        doc = parse_manifest(remote.read_bytes(mpath), mpath)
    except (FastCkptError, FileNotFoundError) as e:
        log.info("fastckpt: no dedup source under %s (%s): files are sent whole", remote.url, e)
        return []
    return [SourceRecord(remote.join(prev.path, name), r.offset, r.length, r.digest)
            for name, recs in records_of(doc).items() for r in recs]


def plan_for(size: int, records: list[Record] | None, previous: list[SourceRecord]) -> list[Part] | None:
    """The part plan of one file, or None when nothing in it can be copied (it is then sent as without dedup)."""
    if not records or not previous or size < MIN_PART:
        return None
    try:
        parts = plan_parts(size, records, previous)
    except IntegrityError as e:  # the records were checked when read: a plan that fails is sent whole
        log.warning("fastckpt: %s", e)
        return None
    return parts if any(p.kind == "copy" for p in parts) else None
