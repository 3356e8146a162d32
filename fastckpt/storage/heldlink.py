"""Naming unnamed files, and checking a name, without letting other Python threads run in between.

A user's ``shutil.rmtree`` (a ``TemporaryDirectory`` cleanup) runs in this process too: it lists a folder, unlinks
what it listed, then removes the folder, and fails ("Directory not empty") if a name appears after the listing.
Its steps interleave with a background writer wherever either releases the GIL (every ``os`` call). These libc
calls go through ``ctypes.PyDLL``, which keeps the GIL: a writer's checks of a folder and the links they guard run
as one step for every other Python thread, so a removal under way is either seen by the checks or has not listed
the folder yet. Each call is a single metadata operation (no data I/O), so holding the GIL costs microseconds.
The one step no check can see, a listing in flight, is covered by ``walked``: ``rmtree`` keeps a folder open from
before it lists it until right before it removes it, so the links wait while the folder is open (``wait_unwalked``).
"""
from __future__ import annotations

import ctypes
import os
import time

__all__ = ["UNNAMED_OK", "link_fd", "present", "wait_unwalked", "walked"]

# linkat(/proc/self/fd/N, AT_SYMLINK_FOLLOW) names an O_TMPFILE file (AT_EMPTY_PATH needs privileges, and os.link
# calls link(2), which would link the /proc symlink itself).
_AT_FDCWD, _AT_SYMLINK_NOFOLLOW, _AT_SYMLINK_FOLLOW, _F_OK = -100, 0x100, 0x400, 0
try:
    _libc = ctypes.PyDLL(None, use_errno=True)
    _linkat, _faccessat, _readlink = _libc.linkat, _libc.faccessat, _libc.readlink
    _opendir, _readdir, _closedir = _libc.opendir, _libc.readdir, _libc.closedir
    _opendir.restype = _readdir.restype = ctypes.c_void_p
    _readdir.argtypes = _closedir.argtypes = [ctypes.c_void_p]
except (OSError, AttributeError):
    _linkat = _faccessat = _readlink = _opendir = None
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
    if _opendir is None:
        return False
    want = os.fsencode(folder)
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
            if n == len(want) and buf.raw[:n] == want:
                return True
    finally:
        _closedir(handle)


def wait_unwalked(folder: str, patience_s: float = 1.0) -> None:
    """Until no descriptor of this process has ``folder`` open (``walked``): a user's ``rmtree`` in this
    process may have listed it, and names linked now would fail its removal. Once it is done the folder is gone and
    the first check before a link says so. Returns with the GIL held since the last look, so the links that follow
    run before any other Python thread can open the folder; after ``patience_s`` (a reader that keeps it open) the
    links go ahead."""
    deadline = time.monotonic() + patience_s
    while walked(folder) and time.monotonic() < deadline:
        time.sleep(0.001)  # lets the walker's thread run (it needs the GIL) and finish
