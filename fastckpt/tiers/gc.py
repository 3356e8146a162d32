"""Garbage collection: the folders of saves that died before their commit.

A save killed before its manifest landed, or a retention delete killed after removing
the manifest, leaves a folder nothing lists and nothing removes. A new ``Checkpointer``
(and ``fastckpt gc ROOT``) removes such a folder only when it can prove that no live
process is still writing it:

* it holds no manifest, and every entry in it is a file fastckpt writes (shards, meta,
  objects, a manifest being committed): a folder with anything else is not ours;
* it is not a save of this process (pending or being recovered from shared memory);
* on a local root, the caller holds the root lock (``fastckpt.tiers.lock``): every live writer
  of the root holds it from its first write on, so nobody else is writing now. A
  ``Checkpointer`` collects once it takes the lock (its first save or delete; distributed:
  at construction), never as a mere reader: a reader holding the lock even briefly could
  refuse a trainer's first save;
* nothing in it changed for ``orphan_grace_s`` seconds. This is the only proof
  on object stores, which have no locks: a writer on another host (or another rank, whose
  files precede the commit) keeps touching its folder while the save runs.

Names prove nothing: anybody may call a file ``shard-00000.0123456789ab.safetensors`` or
``.last.ckpt.fastckpt-tmp-1-2``. So a folder is a dead save's only if, besides the above, every
entry is a plain file (never a symlink) named with one and the same save uid, and one of them
proves by its bytes that fastckpt wrote it: a shard whose safetensors header says
``producer: fastckpt``, or a meta file whose tensor table names that uid's shards. A temporary
file of a single-file save is garbage only with its marker (``fastckpt.storage.tempmark``).
Anything else is left alone, whatever its name, age or content, and symlinks are never followed.
"""
from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from typing import Any, Callable

from ..errors import FastCkptError, StorageError
from ..format.manifest import MANIFEST
from ..format.paths import is_plain_name
from ..storage.local import LocalStorage
from ..storage.protocol import Storage
from ..storage.s3parts import sweep
from ..storage.tempmark import MAX_MARK_BYTES, is_mark_name, is_temp_name, mark_bytes, mark_name

__all__ = ["REMOVING_PREFIX", "collect", "collect_quietly", "collect_temp_files", "collect_uploads", "is_save_folder",
           "is_temp_file"]

log = logging.getLogger("fastckpt")

# What a save writes into its folder: group "uid" is the save's (12 hex digits); a manifest being committed is
# ``manifest.json.tmp-RANDOM`` (``manifest.json.tmp-PID-TID`` before, still recognised).
_OURS = re.compile(r"shard-\d{5}\.(?P<uid>[0-9a-f]{12})\.safetensors|meta\.(?P<muid>[0-9a-f]{12})\.json"
                   r"|objects\.(?P<ouid>[0-9a-f]{12})\.pt"
                   rf"|{re.escape(MANIFEST)}\.tmp-(?:\d+-\d+|[0-9a-f]{{16}})")
_MAX_PROOF_BYTES = 16 << 20  # a shard header or a meta file read as a proof: past this it is not ours to judge


# Retention renames a folder to this hidden sibling before removing it (tiers/catalog.py): a process killed during
# the removal leaves it under this name, never listed (the dot) and sorted oldest by stock Accelerate's "first number
# in the name" (the "-0."), as format/bundle.py's staging folders are. ``collect`` looks at these hidden folders too.
REMOVING_PREFIX = ".fastckpt-removing-0."


def is_temp_file(name: str) -> bool:
    """Whether ``name`` is named like the temporary file (or its marker) of a single-file save: never a checkpoint.
    A name proves nothing: ``collect_temp_files`` removes only what its marker proves."""
    return is_temp_name(name) or is_mark_name(name) is not None


def collect_temp_files(storage: Storage, grace_s: float | None, *, dry_run: bool = False) -> list[str]:
    """Remove the temporary files of single-file saves in ``storage.url`` unchanged for ``grace_s`` seconds, and
    their markers; return exactly the paths removed (or that would be, with ``dry_run``).

    A save killed before its rename leaves ``.NAME.fastckpt-tmp-UID`` and its marker next to the checkpoints; a live
    one keeps writing it until it is renamed, so age is the proof of death here too (``None``: never collect), and
    the marker is the proof of authorship. Problems are logged, never raised: housekeeping must not fail a save.
    On S3, also the multipart uploads of shared saves that died (``collect_uploads``)."""
    modified = getattr(storage, "modified", None)
    if grace_s is None or modified is None or getattr(storage, "read_plain", None) is None:
        return []
    removed: list[str] = []
    now = time.time()
    try:
        names = set(storage.listdir(storage.url))
    except (OSError, FastCkptError) as e:
        log.info("fastckpt: temporary files under %s were not collected: %s", storage.url, e)
        return []
    for name in sorted(names):
        temp = name if is_temp_name(name) else is_mark_name(name)
        if temp is None or (temp != name and temp in names):
            continue  # not ours by name; or a marker whose temporary file is handled with it
        try:
            removed += _collect_temp(storage, temp, temp in names, grace_s, now, dry_run)
        except (OSError, FastCkptError) as e:
            log.info("fastckpt: cannot collect %s: %s", storage.join(storage.url, temp), e)
    return removed + collect_uploads(storage, grace_s, dry_run=dry_run)


def collect_uploads(storage: Storage, grace_s: float | None, *, dry_run: bool = False) -> list[str]:
    """On S3, the object store's temporary files: abort the multipart uploads of shared saves that died (their
    markers ``.fastckpt/uploads/UID.json``, unchanged for ``grace_s`` seconds, name them) and remove the markers;
    return the markers removed (``storage/s3parts.py``). Elsewhere nothing."""
    multipart = getattr(storage, "multipart", None)
    parts = multipart() if callable(multipart) else None
    return [] if parts is None else sweep(storage, parts, grace_s, dry_run)


def _collect_temp(storage: Any, temp: str, with_temp: bool, grace_s: float, now: float, dry_run: bool) -> list[str]:
    """Remove the temporary file ``temp`` (if ``with_temp``) and its marker, if the marker proves them fastckpt's."""
    tpath, mpath = storage.join(storage.url, temp), storage.join(storage.url, mark_name(temp))
    if storage.read_plain(mpath, 0, MAX_MARK_BYTES + 1) != mark_bytes(temp):
        return []  # no marker, or not fastckpt's bytes: not ours, whatever its name says
    paths = [tpath, mpath] if with_temp else [mpath]
    if with_temp and not storage.is_plain_file(tpath):
        return []  # a symlink, a FIFO, a folder under a temporary name: fastckpt never made one
    age = now - max(storage.modified(p) for p in paths)
    if age < grace_s:
        return []
    done = []
    for path in paths:
        if not dry_run:
            storage.delete(path)
        done.append(path)
    log.warning("fastckpt: %s %s: the temporary file of a save that died before its rename, last written %.0f s "
                "ago", "would remove" if dry_run else "removed", tpath if with_temp else mpath, age)
    return done


def collect(storage: Storage, grace_s: float, *, protected: Callable[[str], bool] = lambda name: False,
            dry_run: bool = False) -> list[str]:
    """Remove the dead uncommitted folders under ``storage.url``; return their paths.

    The caller proves there is no other live writer on a local root (it holds the root lock).
    ``protected(name)`` is asked right before each removal (this process's pending saves).
    """
    modified = getattr(storage, "modified", None)
    if modified is None:  # a custom Storage: without modification times nothing can be proven dead
        log.info("fastckpt: %s has no modified(); uncommitted folders are not collected", type(storage).__name__)
        return []
    removed = []
    now = time.time()
    for name in sorted(storage.listdir(storage.url)):
        if not is_plain_name(name) or (name.startswith(".") and not name.startswith(REMOVING_PREFIX)) or protected(name):
            continue
        path = storage.join(storage.url, name)
        age = _dead_for(storage, path, modified, now)
        if age is None or age < grace_s or protected(name):
            continue
        if not dry_run:
            try:
                storage.delete_tree(path)
            except StorageError as e:
                log.warning("fastckpt: could not remove the uncommitted save %s: %s", path, e)
                continue  # reported removed only once it is gone
        log.warning("fastckpt: %s %s: an uncommitted save (no %s) last written %.0f s ago by a process that is "
                    "gone", "would remove" if dry_run else "removed", path, MANIFEST, age)
        removed.append(path)
    return removed


def collect_quietly(storage: Storage, grace_s: float, protected: Callable[[str], bool]) -> list[str]:
    """``collect`` for a ``Checkpointer``'s first write: housekeeping never fails a save, problems are logged."""
    try:
        return collect(storage, grace_s, protected=protected)
    except (OSError, FastCkptError) as e:
        log.warning("fastckpt: uncommitted folders under %s were not collected: %s", storage.url, e)
        return []


def is_save_folder(entries: list[str]) -> bool:
    """Whether ``entries`` are named as an uncommitted save's folder: only files fastckpt writes, each named with a
    save uid (or a manifest being committed), no manifest. Names only: ``collect`` also asks the files themselves."""
    return bool(entries) and MANIFEST not in entries and bool(_save_uids(entries))


def _save_uids(entries: list[str]) -> set[str]:
    """The save uids ``entries`` are named with; empty if any entry is not named as fastckpt names its files."""
    uids = set()
    for e in entries:
        m = _OURS.fullmatch(e)
        if m is None:
            return set()
        uid = m.group("uid") or m.group("muid") or m.group("ouid")
        if uid is not None:
            uids.add(uid)
    return uids


def _dead_for(storage: Storage, path: str, modified: Callable[[str], float], now: float) -> float | None:
    """Seconds since anything in the uncommitted fastckpt folder ``path`` changed; None if it is not one."""
    if getattr(storage, "is_plain_file", None) is None or getattr(storage, "read_plain", None) is None:
        return None  # a custom Storage: authorship cannot be proven
    if isinstance(storage, LocalStorage) and os.path.islink(path):
        return None  # never through a symlink, whatever it points to
    try:
        entries = storage.listdir(path)
    except (NotADirectoryError, StorageError):
        return None  # a file (a Lightning pointer, the lock file) or unreadable: not ours to judge
    if not entries or entries == [path.rstrip("/").rsplit("/", 1)[-1]]:
        return None  # empty, or an object store listing a file as itself
    uids = _save_uids(entries) if MANIFEST not in entries else set()
    if not uids:
        return None
    files = [storage.join(path, e) for e in entries]
    try:
        if not all(storage.is_plain_file(f) for f in files):
            return None  # a symlink, a FIFO or a folder: fastckpt never made one in a save's folder
        if not all(_proven(storage, path, entries, uid) for uid in uids):
            return None  # (a re-save killed before its commit leaves a second uid: each must prove itself)
        newest = max(modified(f) for f in files)
    except (FileNotFoundError, StorageError):
        return None  # changed under us: someone is at work there
    return now - newest


def _proven(storage: Any, path: str, entries: list[str], uid: str) -> bool:
    """Whether a file of save ``uid`` in ``entries`` proves by its bytes that fastckpt wrote it."""
    for e in sorted(entries):
        if f".{uid}." not in e:
            continue
        full = storage.join(path, e)
        if e.startswith("shard-") and _shard_is_ours(storage, full):
            return True
        if e.startswith("meta.") and _meta_is_ours(storage.read_plain(full, 0, _MAX_PROOF_BYTES + 1), uid):
            return True
    return False


def _shard_is_ours(storage: Any, path: str) -> bool:
    head = storage.read_plain(path, 0, 8)
    if head is None or len(head) != 8:
        return False
    n = struct.unpack("<Q", head)[0]
    if n > _MAX_PROOF_BYTES:
        return False
    doc = _json(storage.read_plain(path, 8, n))
    meta = doc.get("__metadata__") if isinstance(doc, dict) else None
    return isinstance(meta, dict) and meta.get("producer") == "fastckpt"


def _meta_is_ours(data: bytes | None, uid: str) -> bool:
    doc = _json(data) if data is not None and len(data) <= _MAX_PROOF_BYTES else None
    tensors = doc.get("tensors") if isinstance(doc, dict) and "tree" in doc else None
    if not isinstance(tensors, list):
        return False
    names = [t.get("file") if isinstance(t, dict) else None for t in tensors]
    objects = doc.get("objects")
    if objects is not None:
        names.append(objects)
    return bool(names) and all(isinstance(n, str) and f".{uid}." in n for n in names)


def _json(data: bytes | None) -> Any:
    try:
        return json.loads(data) if data else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
