"""Naming unnamed files, and checking a name, without letting other Python threads run in between.

A user's ``shutil.rmtree`` (a ``TemporaryDirectory`` cleanup) runs in this process too: it lists a folder, unlinks
what it listed, then removes the folder, and fails ("Directory not empty") if a name appears after the listing.
Its steps interleave with a background writer wherever either releases the GIL (every ``os`` call). These libc
calls go through ``ctypes.PyDLL``, which keeps the GIL: a writer's checks of a folder and the links they guard run
as one step for every other Python thread, so a removal under way is either seen by the checks or has not listed
the folder yet. Each call is a single metadata operation (no data I/O), so holding the GIL costs microseconds.
The one step no check can see, a listing in flight, is covered by ``walked``: ``rmtree`` keeps a folder open from
before it lists it until right before it removes it, so the links wait while the folder is open (``wait_unwalked``).

Removals race such a walk the other way: a name the walk listed and a background thread then removed fails its
unlink or its descent with ``FileNotFoundError`` (retention deleting an old checkpoint while the user removes the
project). ``remove_unwalked`` removes one entry only while no descriptor of this process has its folder or any
folder above it open, the check and the removal as one step; the caller yields to the walk otherwise.
``rename_unwalked`` renames a folder into place the same way (a name that vanishes from a folder the walk listed,
and one that appears there, would both fail it).
"""
from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Collection

__all__ = ["UNNAMED_OK", "guards_of", "link_fd", "present", "remove_unwalked", "rename_unwalked", "wait_unwalked",
           "walked"]

# linkat(/proc/self/fd/N, AT_SYMLINK_FOLLOW) names an O_TMPFILE file (AT_EMPTY_PATH needs privileges, and os.link
# calls link(2), which would link the /proc symlink itself).
_AT_FDCWD, _AT_SYMLINK_NOFOLLOW, _AT_SYMLINK_FOLLOW, _F_OK = -100, 0x100, 0x400, 0
try:
    _libc = ctypes.PyDLL(None, use_errno=True)
    _linkat, _faccessat, _readlink = _libc.linkat, _libc.faccessat, _libc.readlink
    _unlink, _rmdir, _rename = _libc.unlink, _libc.rmdir, _libc.rename
    _opendir, _readdir, _closedir = _libc.opendir, _libc.readdir, _libc.closedir
    _opendir.restype = _readdir.restype = ctypes.c_void_p
    _readdir.argtypes = _closedir.argtypes = [ctypes.c_void_p]
except (OSError, AttributeError):
    _linkat = _faccessat = _readlink = _opendir = _unlink = _rmdir = _rename = None
_D_NAME = 19  # offsetof(struct dirent, d_name) in glibc on 64-bit Linux (d_ino, d_off, d_reclen, d_type)
UNNAMED_OK = _linkat is not None and hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")


def link_fd(fd: int, path: str) -> None:
    """Give the unnamed file open as ``fd`` the name ``path`` (raises ``FileExistsError`` if taken, and
    ``FileNotFoundError`` in a removed folder, which is never recreated)."""
    if _linkat(_AT_FDCWD, f"/proc/self/fd/{fd}".encode(), _AT_FDCWD, os.fsencode(path), _AT_SYMLINK_FOLLOW) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), path)


def present(path: str) -> bool:
    """Whether ``path`` names anything (a link is not followed), the GIL held throughout."""
    if _faccessat is None:
        return os.path.lexists(path)
    return _faccessat(_AT_FDCWD, os.fsencode(path), _F_OK, _AT_SYMLINK_NOFOLLOW) == 0


def walked(folder: str) -> bool:
    """Whether a descriptor of this process has ``folder`` (a real path: no link in it) open, the GIL held
    throughout: a ``shutil.rmtree`` keeps each folder open from before it lists it until right before it removes it,
    so True means a walk may have listed it and no name may appear there now. False where ``/proc/self/fd`` cannot
    be read (nothing to go by)."""
    return _walked_any(frozenset([os.fsencode(folder)]))


def _walked_any(wanted: Collection[bytes]) -> bool:
    """Whether a descriptor of this process has one of ``wanted`` (real paths, encoded) open, the GIL held."""
    if _opendir is None:
        return False
    handle = _opendir(b"/proc/self/fd")
    if not handle:
        return False
    buf = ctypes.create_string_buffer(4096)
    try:
        while True:
            entry = _readdir(handle)
            if not entry:
                return False
            name = ctypes.string_at(entry + _D_NAME)
            n = _readlink(b"/proc/self/fd/" + name, buf, len(buf))
            if n > 0 and buf.raw[:n] in wanted:
                return True
    finally:
        _closedir(handle)


def guards_of(folder: str) -> frozenset[bytes]:
    """``folder``'s real path and every folder above it, encoded: what a walk that may list ``folder`` holds open
    (``rmtree`` of the folder itself or of any folder above it)."""
    path = os.path.realpath(folder)
    found = {os.fsencode(path)}
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        found.add(os.fsencode(path))
    return frozenset(found)


def remove_unwalked(path: str, guards: Collection[bytes], *, folder: bool = False) -> bool:
    """Unlink ``path`` (``folder``: remove the empty folder) unless a descriptor of this process has one of
    ``guards`` (``guards_of`` its folder) open; the check and the removal run as one step for every other Python
    thread. True: removed, or already gone; False: a walk holds a guard open, nothing was done (yield to it: it may
    have listed ``path``). Other errors raise ``OSError`` as ``os.remove``/``os.rmdir`` would."""
    if _unlink is None or _rmdir is None:  # no libc to keep the GIL with: remove as os does (no walk is seen)
        try:
            (os.rmdir if folder else os.remove)(path)
        except FileNotFoundError:
            pass
        return True
    if _walked_any(guards):
        return False
    if (_rmdir if folder else _unlink)(os.fsencode(path)) != 0:
        code = ctypes.get_errno()
        if code != errno.ENOENT:
            raise OSError(code, os.strerror(code), path)
    return True


def rename_unwalked(src: str, dst: str, guards: Collection[bytes]) -> bool:
    """Rename ``src`` to ``dst`` (no parent is created) unless a descriptor of this process has one of ``guards``
    (``guards_of`` the folder holding both) open; the check and the rename run as one step for every other Python
    thread. True: renamed; False: a walk holds a guard open, nothing was done (yield to it). Errors raise ``OSError``
    as ``os.rename`` would (``FileNotFoundError``: ``src`` or its folder is gone)."""
    if _rename is None:  # no libc to keep the GIL with: rename as os does (no walk is seen)
        os.rename(src, dst)
        return True
    if _walked_any(guards):
        return False
    if _rename(os.fsencode(src), os.fsencode(dst)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), src, None, dst)
    return True


def wait_unwalked(folder: str, patience_s: float = 1.0) -> None:
    """Until no descriptor of this process has ``folder`` open (``walked``): a user's ``rmtree`` in this
    process may have listed it, and names linked now would fail its removal. Once it is done the folder is gone and
    the first check before a link says so. Returns with the GIL held since the last look, so the links that follow
    run before any other Python thread can open the folder; after ``patience_s`` (a reader that keeps it open) the
    links go ahead."""
    deadline = time.monotonic() + patience_s
    while walked(folder) and time.monotonic() < deadline:
        time.sleep(0.001)  # lets the walker's thread run (it needs the GIL) and finish
