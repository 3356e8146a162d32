"""The copy source of a direct object-store root (``Checkpointer(root="s3://...")``, no local tier): the newest
checkpoint committed under the root, whose content records the shards of the next save are planned against.

The I/O workers hash each shard (``format/openlayout.py``) and ask ``DirectDedup.previous()`` for the records of
the copy source: the last checkpoint this process committed (``committed``, called by the committer), or before
the first commit, the newest by name among the root's checkpoints whose manifest reads back (a resumed run).
Its manifest is read once and cached. Only a single writer plans: with ``distributed=True`` the ranks that write
shards do not see the commits, so their shards are sent whole (the multi-rank seam is
``format/objectdedup.plan_object``).
"""
from __future__ import annotations

import logging
import re
import threading
from typing import Any, Callable

from ..errors import FastCkptError
from ..format.contenthash import file_records
from ..format.layout import MANIFEST, parse_manifest
from ..format.objectdedup import copies_ranges
from ..storage.partplan import SourceRecord
from ..storage.local import LocalStorage
from ..storage.protocol import Storage
from ..storage.reflink import supports_reflink
from ..storage.s3copy import CopyOutcome

__all__ = ["DirectDedup"]

log = logging.getLogger("fastckpt")

_RESUME_TRIES = 4  # folders looked at, newest name first, for the copy source of a resumed run's first save


class DirectDedup:
    """One per ``Saver``: the copy source of its root's shards, and what the planned writes did."""

    def __init__(self, storage: Storage, enabled: bool, reflink: bool = False, fsync: bool = True,
                 upload_records: bool = False) -> None:
        self.storage = storage
        self.enabled = enabled and copies_ranges(storage)
        # a root the remote tier uploads with dedup: a folder's members list their content records in its manifest
        # too (format/bundlededup.py), against which the upload plans its copies (tiers/dedup.py)
        self.upload_records = upload_records and not self.enabled
        # a local root: unchanged shards are clones (format/clonewrite.py) where its file system has reflinks,
        # probed at the first save (storage/reflink.py); ``clones`` says whether it has
        self._reflink = reflink and isinstance(storage, LocalStorage)
        self._clones: bool | None = None if self._reflink else False
        self.fsync = fsync
        self.cloned_bytes = 0  # bytes of shards made by a clone (shared with the previous checkpoint's files)
        self._crcs: dict[str, int] = {}  # path -> CRC32C its manifest lists, for the files of ``_cached``
        self._lock = threading.Lock()
        self._newest: str | None = None  # the folder of the newest committed checkpoint, once known
        self._looked = False  # the root was searched for one (a resumed run's first save)
        self._cached: tuple[str, list[SourceRecord]] | None = None
        self.sent = 0  # bytes of planned files sent (whole files and the sent parts)
        self.copied = 0  # bytes the store copied from the previous checkpoint instead
        self.fell_back = 0  # bytes planned as copies but sent (source gone, refused, or checksum mismatch)

    @classmethod
    def of(cls, config: Any, storage: Storage, single_writer: bool, uploads: bool = False) -> "DirectDedup":
        """The saver's: with ``distributed=True`` (not a single writer) the ranks do not see the commits;
        ``uploads``: this process hands its commits to the remote tier."""
        return cls(storage, config.remote.dedup and single_writer, config.persist.reflink == "auto" and single_writer,
                   config.persist.fsync, config.remote.dedup and uploads)

    @property
    def clones(self) -> bool:
        """Whether this local root's shards may be cloned (the file system probed once, at the first ask)."""
        if self._clones is None:
            self._clones = supports_reflink(self.storage.url)
        return self._clones

    def watching(self, on_commit: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        """``on_commit`` that first notes a committed checkpoint of the root as the next copy source."""
        def committed(job: Any, info: Any) -> None:
            if (self.enabled or self._reflink) and job.file_format.catalogued:
                with self._lock:
                    self._newest, self._looked = info.path, True
            on_commit(job, info)
        return committed

    def source(self, uploaded: bool = True) -> "DirectDedup | None":
        """What a save's job carries (``Job.dedup``): this, or None when nothing can be copied. ``uploaded``: the
        save is a checkpoint of the root (the remote tier uploads it), not a framework's file (``save_file``)."""
        return self if self.enabled or (self.upload_records and uploaded) or self.clones else None

    def previous(self) -> list[SourceRecord]:
        """Called by an I/O worker: the records of the newest committed checkpoint (empty: none, or unreadable)."""
        with self._lock:
            if not self._looked:
                self._newest, self._looked = self._find_newest(), True
            newest, cached = self._newest, self._cached
            if newest is None:
                return []
            if cached is not None and cached[0] == newest:
                return cached[1]
            self._crcs = {}
            recs = self._records(newest)
            self._cached = (newest, recs)
            return recs

    def listed_crc(self, path: str) -> int | None:
        """The CRC32C the copy source's manifest lists for its file ``path`` (after ``previous()``), or None."""
        with self._lock:
            return self._crcs.get(path)

    def done(self, size: int, outcome: CopyOutcome | None) -> None:
        with self._lock:
            if outcome is None:
                self.sent += size
            else:
                self.sent += outcome.sent
                self.copied += outcome.copied
                self.fell_back += outcome.fell_back

    def cloned(self, size: int, written: int) -> None:
        with self._lock:
            self.cloned_bytes += size - written
            self.sent += written

    def _records(self, folder: str) -> list[SourceRecord]:
        st = self.storage
        mpath = st.join(folder, MANIFEST)
        try:
            doc = parse_manifest(st.read_bytes(mpath), mpath)
        except (FastCkptError, FileNotFoundError) as e:
            log.info("fastckpt: no dedup source in %s (%s): shards are sent whole", folder, e)
            return []
        out = []
        for name, rec in doc["files"].items():
            self._crcs[st.join(folder, name)] = int(rec["crc32c"])
            for r in file_records(rec, int(rec["size"])) or []:
                out.append(SourceRecord(st.join(folder, name), r.offset, r.length, r.digest))
        return out

    def _find_newest(self) -> str | None:
        """A resumed run: the root's newest checkpoint by name, numbers compared as numbers (``step-NNNNNNNNN``,
        Accelerate's ``checkpoint_10`` after ``checkpoint_9``), whose manifest reads back. A wrong guess costs only bytes: every copy is checked against the local bytes."""
        st = self.storage
        try:
            names = sorted((n for n in st.listdir(st.url) if not n.startswith(".")), key=_by_number, reverse=True)
        except (FastCkptError, FileNotFoundError) as e:
            log.info("fastckpt: cannot list %s for a dedup source (%s): shards are sent whole", st.url, e)
            return None
        for name in names[:_RESUME_TRIES]:
            folder = st.join(st.url, name)
            try:
                parse_manifest(st.read_bytes(st.join(folder, MANIFEST)), folder)
            except (FastCkptError, FileNotFoundError):
                continue
            return folder
        return None


def _by_number(name: str) -> tuple[tuple[int, int | str], ...]:
    """``name`` cut into runs of digits (compared as numbers) and of other characters."""
    return tuple((0, int(run)) if run.isdigit() else (1, run) for run in re.findall(r"\d+|\D+", name))
