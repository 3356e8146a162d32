"""Removing a local folder in the background without failing a user's removal of it, or of a folder above it.

Retention deletes an old checkpoint folder on a background thread once a newer save commits. A user's
``shutil.rmtree(project_dir)`` right after ``save_state()`` (a cleanup script, a test's teardown) walks the same
tree in this process: it lists a folder, then unlinks or descends into what it listed, so an entry a background
thread removed in between fails it with ``FileNotFoundError`` (the manifest, a member file, the old checkpoint
folder itself). Stock Accelerate deletes old folders inside ``save_state()``, on the caller's thread, so there the
removal always wins.

``remove_folder`` takes out one entry at a time, each only while no descriptor of this process has its folder or
a folder above it open (``heldlink.remove_unwalked``: ``rmtree`` keeps every folder of its walk open from before
it lists it until right before it removes it). While a walk holds one, it waits for it to finish (the walk
removes what it listed, then our removals find nothing); a walk that holds on past ``patience_s`` is not one that
ends soon (a reader keeping a folder open): the removal stops there and reports it, so retention retries later,
instead of racing it. A big file is held open (``O_PATH``) across its unlink, so the unlink, which runs with the
GIL held, only drops the name: the blocks are freed when that descriptor closes, with the GIL released.
"""
from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Collection, Iterator, Sequence

from .heldlink import guards_of, remove_unwalked

__all__ = ["remove_folder"]

_O_PATH = getattr(os, "O_PATH", 0)  # Linux: a descriptor that only pins the inode (never blocks, reads nothing)


def remove_folder(path: str, first: Sequence[str] = (), patience_s: float = 1.0) -> bool:
    """Remove the local folder ``path`` and everything in it, the names ``first`` first (a manifest: a folder half
    removed is never taken for a committed checkpoint), each removal yielding to a walk of this process. True:
    ``path`` is gone (by us or by the walk); False: a walk held on past ``patience_s``, and the rest is left to it
    or to a later try. A link in the tree is removed, never followed. Errors other than a missing entry raise
    ``OSError``."""
    deadline = time.monotonic() + patience_s
    guards = guards_of(path)
    for name in first:
        if not _remove(os.path.join(path, name), guards, deadline, folder=False):
            return False
    return _remove_tree(path, guards, deadline)


def _remove_tree(path: str, guards: Collection[bytes], deadline: float) -> bool:
    inner = guards | guards_of(path)  # a subfolder: its own path joins the folders a walk of it holds open
    for entry in _entries(path):
        if entry.is_dir(follow_symlinks=False):
            done = _remove_tree(entry.path, inner, deadline)
        else:
            done = _remove(entry.path, inner, deadline, folder=False)
        if not done:
            return False
    return _remove(path, guards, deadline, folder=True)


def _entries(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as listing:
            return list(listing)
    except FileNotFoundError:  # removed meanwhile (by the walk we waited for): nothing left to list
        return []


def _remove(path: str, guards: Collection[bytes], deadline: float, *, folder: bool) -> bool:
    with _pinned(path, folder):
        while not remove_unwalked(path, guards, folder=folder):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)  # lets the walk's thread run (it needs the GIL) and finish
    return True


@contextlib.contextmanager
def _pinned(path: str, folder: bool) -> Iterator[None]:
    """Hold a regular file open across its unlink: freeing its blocks (long for a big file) then waits for the
    close, which releases the GIL, not for the unlink, which keeps it."""
    fd = -1
    if not folder and _O_PATH:
        with contextlib.suppress(OSError):  # missing, or not ours to open: the unlink says what it is
            fd = os.open(path, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                fd = -1
    try:
        yield
    finally:
        if fd >= 0:
            os.close(fd)
