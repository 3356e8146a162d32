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
"""
from __future__ import annotations

import logging
import re
import time
from typing import Callable

from ..errors import FastCkptError, StorageError
from ..format.layout import MANIFEST
from ..format.paths import is_plain_name
from ..storage.protocol import Storage

__all__ = ["collect", "collect_quietly", "collect_temp_files", "is_save_folder", "is_temp_file"]

log = logging.getLogger("fastckpt")

# What a save writes into its folder (uids are 12 hex digits; the tmp suffix is pid-thread).
_OURS = re.compile(r"shard-\d{5}\.[0-9a-f]{12}\.safetensors|meta\.[0-9a-f]{12}\.json|objects\.[0-9a-f]{12}\.pt"
                   rf"|{re.escape(MANIFEST)}\.tmp-\d+-\d+")

# The hidden file a single-file save (a Lightning .ckpt) is written into before its rename:
# ``.NAME.fastckpt-tmp-PID-TID`` (one writer) or ``.NAME.fastckpt-tmp-UID`` (FastDDPStrategy's shared writes).
_TEMP = re.compile(r"\..+\.fastckpt-tmp-[0-9A-Za-z_-]+")


def is_temp_file(name: str) -> bool:
    """Whether ``name`` is the temporary file of a single-file save (never a checkpoint)."""
    return bool(_TEMP.fullmatch(name))


def collect_temp_files(storage: Storage, grace_s: float | None, *, dry_run: bool = False) -> list[str]:
    """Remove the temporary files of single-file saves in ``storage.url`` unchanged for ``grace_s`` seconds.

    A save killed before its rename leaves ``.NAME.fastckpt-tmp-*`` next to the checkpoints; a live one keeps
    writing it until it is renamed, so age is the proof of death here too (``None``: never collect). Problems are
    logged, never raised: housekeeping must not fail a save."""
    modified = getattr(storage, "modified", None)
    if grace_s is None or modified is None:
        return []
    removed = []
    now = time.time()
    try:
        names = sorted(storage.listdir(storage.url))
    except (OSError, FastCkptError) as e:
        log.info("fastckpt: temporary files under %s were not collected: %s", storage.url, e)
        return []
    for name in names:
        if not is_temp_file(name):
            continue
        path = storage.join(storage.url, name)
        try:
            age = now - modified(path)
            if age < grace_s:
                continue
            if not dry_run:
                storage.delete(path)
        except (OSError, FastCkptError) as e:
            log.info("fastckpt: cannot collect %s: %s", path, e)
            continue
        log.warning("fastckpt: %s %s: the temporary file of a save that died before its rename, last written "
                    "%.0f s ago", "would remove" if dry_run else "removed", path, age)
        removed.append(path)
    return removed


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
        if not is_plain_name(name) or name.startswith(".") or protected(name):
            continue
        path = storage.join(storage.url, name)
        age = _dead_for(storage, path, modified, now)
        if age is None or age < grace_s or protected(name):
            continue
        if not dry_run:
            storage.delete_tree(path)
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
    """Whether a folder holding ``entries`` is an uncommitted save's: only files fastckpt writes, no manifest."""
    return bool(entries) and MANIFEST not in entries and all(_OURS.fullmatch(e) for e in entries)


def _dead_for(storage: Storage, path: str, modified: Callable[[str], float], now: float) -> float | None:
    """Seconds since anything in the uncommitted fastckpt folder ``path`` changed; None if it is not one."""
    try:
        entries = storage.listdir(path)
    except (NotADirectoryError, StorageError):
        return None  # a file (a Lightning pointer, the lock file) or unreadable: not ours to judge
    if not entries or entries == [path.rstrip("/").rsplit("/", 1)[-1]]:
        return None  # empty, or an object store listing a file as itself
    if not is_save_folder(entries):
        return None
    try:
        newest = max(modified(storage.join(path, e)) for e in entries)
    except (FileNotFoundError, StorageError):
        return None  # changed under us: someone is at work there
    return now - newest
