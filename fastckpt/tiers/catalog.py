"""The committed checkpoints under one root: listing, lookup, deletion, retention.

Only manifests count. A directory without one (an interrupted save, or an object
store prefix that lingers after deletion) is invisible.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from typing import Protocol, Sequence, TypeVar

from ..config import RetentionOptions
from ..errors import CheckpointNotFoundError, FastCkptError, IntegrityError, StorageError
from ..format.healthrecord import healthy_of
from ..format.manifest import MANIFEST, parse_manifest
from ..format.manifest import CheckpointInfo
from ..format.paths import confine
from ..storage.deadline import storage_error
from ..storage.local import LocalStorage
from ..storage.heldlink import guards_of, rename_unwalked
from ..storage.yieldremove import remove_folder
from ..storage.protocol import Storage
from .gc import REMOVING_PREFIX

__all__ = ["Catalog", "doomed"]

log = logging.getLogger("fastckpt")


class _Step(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def step(self) -> int: ...


T = TypeVar("T", bound=_Step)


def doomed(infos: Sequence[T], rules: RetentionOptions, pending: set[str]) -> list[T]:
    """Of ``infos`` (anything with ``name`` and ``step``, and ``healthy`` when measured; oldest step first), those
    ``rules`` do not keep: never the newest, never the newest healthy one, never a pending name. ``fastckpt gc``
    applies it to Lightning and Accelerate folders too."""
    if rules.keep_last is None:
        return []
    sick = {i.name for i in infos if getattr(i, "healthy", None) is False}  # None: not measured, counted as healthy
    counted = infos if rules.unhealthy == "count" else [i for i in infos if i.name not in sick]
    keep = {i.name for i in counted[-rules.keep_last:]}
    if rules.keep_every_n_steps:
        keep |= {i.name for i in infos if i.step % rules.keep_every_n_steps == 0}
    if rules.unhealthy == "keep":
        keep |= sick
    healthy = [i for i in infos if getattr(i, "healthy", None) is True]
    if healthy:  # a run that turned NaN must still resume from before it, whatever keep_last says
        keep.add(healthy[-1].name)
    return [i for i in infos[:-1] if i.name not in keep and i.name not in pending]


class Catalog:
    """Reads manifests lazily and caches what it read; the committer keeps it current."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self._lock = threading.Lock()
        self._known: dict[str, CheckpointInfo] = {}

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints under the root, oldest step first."""
        found: dict[str, CheckpointInfo] = {}
        for name in self.storage.listdir(self.storage.url):
            if name.startswith("."):  # never a checkpoint's name (format/paths.py): fastckpt's own, or a staged folder
                continue
            info = self._known.get(name) or self.info(name)
            if info is not None:
                found[name] = info
        with self._lock:
            self._known = found
        return sorted(found.values(), key=lambda i: (i.step, i.name))

    def info(self, name: str) -> CheckpointInfo | None:
        """The committed checkpoint ``name``, read from its manifest, or None.

        A malformed, crafted or unreadable-as-a-file manifest (or a checkpoint symlinked from outside the
        root) is skipped with a warning naming it: one bad entry must not stop every resume from the root.
        """
        path = self.storage.join(self.storage.url, name)
        mpath = self.storage.join(path, MANIFEST)
        try:
            confine(self.storage.url, path, "checkpoint directory")
            doc = parse_manifest(self.storage.read_bytes(mpath), mpath)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except IntegrityError as e:
            log.warning("fastckpt: ignoring %s: %s", path, e)
            return None
        except StorageError as e:
            if getattr(e, "errno", None) not in (errno.EISDIR, errno.ENOTDIR):
                raise
            log.warning("fastckpt: ignoring %s: its %s is not a file", path, MANIFEST)
            return None
        return CheckpointInfo(name, doc["step"], path, doc.get("nbytes", 0), healthy=healthy_of(doc))

    @staticmethod
    def damage_of(storage: Storage, path: str, doc: dict, present: list[str] | None = None) -> str | None:
        """What a committed checkpoint lacks, or None when every file its manifest lists is there (at its listed size
        where sizes are cheap: a local folder). ``present``: the folder's names when the caller listed it already.

        A folder removed by hand part way (``rm -r`` interrupted, a sync that copied only some files) keeps its
        manifest while shards are gone: listings show it as damaged and a load says which older step is whole.
        No byte is read: ``fastckpt verify`` checks the contents.
        """
        try:
            names = set(present if present is not None else storage.listdir(path))
        except (FastCkptError, OSError) as e:
            return f"its folder cannot be listed: {e}"
        missing = [f for f in doc["files"] if f not in names]
        if missing:
            shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
            return f"{len(missing)} of its {len(doc['files'])} files are missing ({shown})"
        if isinstance(storage, LocalStorage):
            for f, rec in doc["files"].items():
                try:
                    size = os.stat(os.path.join(path, f)).st_size
                except OSError as e:
                    return f"{f} cannot be read: {e.strerror}"
                if size != rec["size"]:
                    return f"{f} is {size} bytes, its manifest says {rec['size']} (truncated or replaced)"
        return None

    def damage(self, name: str) -> str | None:
        """``damage_of`` of the committed checkpoint ``name`` (None when whole, or when it is not committed)."""
        path = self.storage.join(self.storage.url, name)
        mpath = self.storage.join(path, MANIFEST)
        try:
            doc = parse_manifest(self.storage.read_bytes(mpath), mpath)
        except (FastCkptError, OSError):
            return None  # not committed (or unreadable): Catalog.list never offers it
        return self.damage_of(self.storage, path, doc)

    def committed(self, info: CheckpointInfo) -> None:
        """Called by the committer right after a manifest lands."""
        with self._lock:
            self._known[info.name] = info

    def resolve(self, step: int | None) -> str:
        """The name of the newest committed checkpoint (at ``step`` when given)."""
        infos = self.list()
        if step is not None:
            infos = [i for i in infos if i.step == step]
        if not infos:
            what = f"at step {step}" if step is not None else "at all"
            raise CheckpointNotFoundError(f"no committed checkpoint {what} under {self.storage.url}")
        return infos[-1].name

    def delete(self, name: str, *, yielding: bool = False) -> bool:
        """Remove ``name``: manifest first, so a half-deleted checkpoint is never visible.

        Only plain names under the checkpoint directory are deleted (``parse_manifest`` refuses others);
        a malformed or crafted manifest leaves its listed files to ``delete_tree``, which stays inside.
        ``yielding`` (retention, on a background thread): a local folder is removed one entry at a time, each
        yielding to a walk of this process over it (the user's ``rmtree`` of the project): False when the rest was
        left to that walk or to a later retention (``storage/yieldremove.py``); True once it is gone.
        """
        path = confine(self.storage.url, self.storage.join(self.storage.url, name), "checkpoint directory")
        if isinstance(self.storage, LocalStorage) and os.path.islink(path):
            # fastckpt never creates a symlink: what it names is somebody else's, never deleted through it
            raise StorageError(f"{path} is a symlink, not a checkpoint folder fastckpt wrote: not deleted (nor what "
                               "it points to); remove the link by hand if it is yours to remove")
        mpath = self.storage.join(path, MANIFEST)
        if yielding and isinstance(self.storage, LocalStorage):
            try:
                gone = _remove_local(path, name)
            except OSError as e:
                raise storage_error("deleting", path, e) from e
            if gone or not os.path.lexists(mpath):  # uncommitted now, whoever removes the rest
                with self._lock:
                    self._known.pop(name, None)
            return gone
        try:
            files = list(parse_manifest(self.storage.read_bytes(mpath), mpath)["files"])
        except (FileNotFoundError, IntegrityError) as e:
            if isinstance(e, IntegrityError):
                log.warning("fastckpt: deleting %s without trusting its manifest: %s", path, e)
            files = []
        self.storage.delete(mpath)
        for f in files:
            self.storage.delete(self.storage.join(path, f))
        self.storage.delete_tree(path)
        with self._lock:
            self._known.pop(name, None)
        return True

    def doomed(self, rules: RetentionOptions, pending: set[str]) -> list[CheckpointInfo]:
        """The committed checkpoints ``rules`` do not keep (``fastckpt gc --dry-run`` prints them)."""
        return doomed(self.list(), rules, pending) if rules.keep_last is not None else []

    def retain(self, rules: RetentionOptions, pending: set[str]) -> None:
        """Delete what ``rules`` do not keep; never the newest committed one, never a pending name."""
        if rules.keep_last is None:
            return
        try:
            doomed = self.doomed(rules, pending)
        except FastCkptError as e:
            log.warning("fastckpt: retention skipped, cannot list %s: %s", self.storage.url, e)
            return
        for info in doomed:
            try:
                if not self.delete(info.name, yielding=True):
                    # A walk of this process (the user's rmtree of the project) holds the folder or one above it
                    # open: it removes what it listed; a later retention removes whatever it leaves.
                    log.info("fastckpt: retention left %s to a removal in progress (retried after the next save)",
                             info.path)
                    return
                log.info("fastckpt: retention removed %s (step %d)", info.name, info.step)
            except FastCkptError as e:
                log.warning("fastckpt: retention could not remove %s: %s", info.path, e)


def _remove_local(path: str, name: str) -> bool:
    """Retention's removal of the local checkpoint folder ``path``: out of sight first, then entry by entry.

    One rename takes it from its name, so a process killed during the removal (which takes many unlinks) leaves no
    half folder under a checkpoint's name, which stock readers (Accelerate's ``total_limit`` and ``load_state``,
    a copy of the project) would count or take for a checkpoint. A walk of this process holding the root open (the
    user's ``rmtree`` of the project, which may have listed the name) gets the removal in place instead, manifest
    first, each entry yielding to it (storage/yieldremove.py). True: gone; False: left to such a walk. A process
    killed after the rename leaves the hidden folder, its manifest removed first: tiers/gc.py collects it as the dead
    save it then looks like (its files proven fastckpt's by their bytes), at the next writer's first write or by
    ``fastckpt gc``; killed between the rename and that first removal, it stays, hidden and never listed."""
    parent = os.path.dirname(path)
    hidden = os.path.join(parent, REMOVING_PREFIX + name)
    if os.path.lexists(hidden):  # a leftover of this name (gc's to prove dead, never removed by its name): in place
        return remove_folder(path, first=[MANIFEST])
    try:
        moved = rename_unwalked(path, hidden, guards_of(parent))
    except FileNotFoundError:
        return True  # gone already (a user's removal won the race)
    except OSError:  # a name too long for the prefix, a file system refusing the rename: in place, as before
        moved = False
    return remove_folder(hidden if moved else path, first=[MANIFEST])
