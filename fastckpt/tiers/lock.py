"""One writer per root: an advisory lock on a file in a local root.

Two processes writing one root would run each other's retention: one deleted a folder
the other was committing into. The writer of a local root therefore holds
``fcntl.flock`` on ``ROOT/.fastckpt.lock`` from its first write (save, delete,
recovery, garbage collection) until ``close()``; a second writer is refused with an
error naming the root and the holder's pid. The kernel drops the lock when the holder
dies, even by SIGKILL, so a crash never leaves a stale lock behind. Readers (``load``,
``list``) never take it. With ``distributed=True`` only rank 0 takes it: the other
ranks write only inside saves that rank 0 commits.

Object stores have no locks: there, only the garbage collector's grace period protects
a live writer (see ``fastckpt.tiers.gc``).
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import weakref

from ..errors import StorageError

__all__ = ["LOCK_NAME", "RootLock"]

log = logging.getLogger("fastckpt")

LOCK_NAME = ".fastckpt.lock"  # a leading dot: never a checkpoint name (Checkpointer refuses those)
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

_open_locks: "weakref.WeakSet[RootLock]" = weakref.WeakSet()


class RootLock:
    """The writer's lock of one local root; ``acquire`` raises, ``try_acquire`` reports."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, LOCK_NAME)
        self._fd: int | None = None
        self._mutex = threading.Lock()  # save() and delete() may claim from two threads at once
        self.supported = True  # False on filesystems without flock (then nothing is proven)

    @staticmethod
    def for_root(url: str) -> "RootLock | None":
        """The lock of a local root, or None for a URL (object stores have no locks)."""
        if "://" in url and not url.startswith("file://"):
            return None
        return RootLock(os.path.abspath(url.removeprefix("file://")))

    @property
    def held(self) -> bool:
        """Whether this process holds the lock through this object."""
        return self._fd is not None

    def try_acquire(self) -> bool:
        """Take the lock if it is free (idempotent); False if another process (or object) holds it."""
        with self._mutex:
            return self._try_acquire()

    def _try_acquire(self) -> bool:
        if self._fd is not None or not self.supported:
            return True
        os.makedirs(self.root, exist_ok=True)
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            if e.errno in _UNSUPPORTED:
                self._unsupported(e)
                return True
            raise
        self._fd = fd
        _open_locks.add(self)
        holder = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder, 0)  # for the error message of the next writer
        return True

    def _open(self) -> int:
        """The lock file, created if absent. It is written (the holder's pid), so it must be fastckpt's own: never
        a symlink (O_NOFOLLOW), a FIFO (O_NONBLOCK, then refused), or a hard link to another file (a link count
        above 1): any of those planted in the root is refused with ``StorageError``, the file it names untouched."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
                raise
            raise StorageError(self._not_ours(f"a symlink, a FIFO or a folder ({e.strerror})")) from e
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a hard link ({st.st_nlink} names)"
            raise StorageError(self._not_ours(what))
        return fd

    def _not_ours(self, what: str) -> str:
        return (f"the lock file {self.path} of checkpoint root {self.root} is {what}: fastckpt creates it as a plain "
                "file and writes into it, so it refuses to use (or write through) anything else there. Remove it "
                "(it is not fastckpt's) and start again")

    def acquire(self) -> None:
        """Take the lock or raise ``StorageError`` naming the root and the holder."""
        try:
            if self.try_acquire():
                return
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(f"cannot create the lock file {self.path} of checkpoint root {self.root}: {e}. "
                               "The writer of a root needs write access to it") from e
        raise StorageError(
            f"checkpoint root {self.root} is in use by another writer ({self.holder()}, holding {self.path}). Two "
            "writers of one root delete each other's checkpoints: stop the other process, or give this one its "
            "own root. The lock is released when the holder closes its Checkpointer or exits")

    def holder(self) -> str:
        """Who holds the lock, as written by its holder."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError("not a regular file")
                info = json.loads(f.read(4096) or b"{}")
            return f"pid {int(info['pid'])} on host {info.get('host', '?')}"
        except (OSError, ValueError, KeyError, TypeError):
            return "a process that took it a moment ago and has not written its pid yet"

    def release(self) -> None:
        """Called by ``Checkpointer.close``; idempotent."""
        with self._mutex:
            fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def _forget(self) -> None:
        """In a fork()ed child: close the inherited descriptor without unlocking the parent's lock."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # the lock lives while the parent's descriptor is open; a lingering child must not hold it

    def _unsupported(self, e: OSError) -> None:
        self.supported = False
        log.warning("fastckpt: %s does not support file locks (%s); two writers of this root are not detected",
                    self.root, e)


def _forget_in_child() -> None:
    for lock in list(_open_locks):
        lock._forget()


os.register_at_fork(after_in_child=_forget_in_child)
