"""Trusting the shared-memory tier's files: only what this user made, never through a link, never a FIFO.

The namespace's name (``fastckpt-<hash(root)>``) is predictable, and ``/dev/shm`` is writable by every
user: another uid can create it first, or plant a complete, checksummed snapshot in it, and a snapshot
found there is committed as this user's checkpoint. So:

* the namespace is created ``0700`` and used only if it is a real folder (``lstat``: never followed)
  owned by this uid and writable by no one else; the folder holding it (``staging.shm_dir``) must be this
  user's or root's, and writable by others only with the sticky bit (``/dev/shm``), so that nobody else
  can rename the namespace away and put theirs in its place;
* every folder and file inside is checked the same way before it is used, and files are opened with
  ``O_NOFOLLOW | O_NONBLOCK`` and checked with ``fstat`` before a byte is read: a FIFO would block the
  open or the read forever, a symlink would read (or ``mmap``) someone else's file.

Inside a namespace that passed, only this uid (or root) can have created anything, so a foreign entry is
skipped with a warning, never removed: it is not ours to delete.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat

import torch

from ..errors import IntegrityError, UnsafeCheckpointError

__all__ = ["ALIVE", "check_namespace", "check_entry", "open_trusted", "foreign_reason", "lock_held", "open_buffer",
           "open_buffer_fd", "read_record"]

ALIVE = "alive.lock"  # in each owner's folder, locked while the owner runs
_MAX_RECORD_BYTES = 256 << 20  # a record holds names and the tree, never tensor bytes

log = logging.getLogger("fastckpt")

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
_TRUSTED_PARENT_UIDS = (0,)  # root's /dev/shm (1777, sticky) is the usual parent


def foreign_reason(st: os.stat_result, want_dir: bool) -> str | None:
    """Why an entry with ``st`` (from ``lstat`` or ``fstat``) must not be used; None if it may."""
    kind = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if not kind:
        return f"it is {_kind(st.st_mode)}, not {'a folder' if want_dir else 'a regular file'}"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & _OTHERS_WRITE:
        return f"other users may write it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_entry(path: str, want_dir: bool, what: str) -> bool:
    """Whether ``path`` (not followed) is a folder (``want_dir``) or regular file this user made and only this
    user can write; if it exists but is not, warn naming it and answer False (the caller skips it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("fastckpt: ignoring the %s %s: cannot check it (%s)", what, path, e)
        return False
    why = foreign_reason(st, want_dir)
    if why is not None:
        log.warning("fastckpt: ignoring the %s %s, which fastckpt did not create for this user: %s; it is left "
                    "as it is", what, path, why)
        return False
    return True


def open_trusted(path: str, flags: int, what: str, mode: int = 0o600) -> int:
    """Open the regular file ``path`` (never through a symlink, never blocking on a FIFO) and check with ``fstat``
    that this user made it and only this user can write it; else ``UnsafeCheckpointError`` naming it. Other
    ``OSError``s (missing file) propagate as they are."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        why = foreign_reason(os.fstat(fd), want_dir=False)
        if why is not None:
            raise UnsafeCheckpointError(f"{path}: refusing to use this {what}: {why}. fastckpt did not create it "
                                        "for this user; remove it if it is not yours")
        os.set_blocking(fd, True)  # a regular file: O_NONBLOCK served only the open
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_namespace(shm_dir: str, base: str) -> None:
    """Create the namespace ``base`` under ``shm_dir`` (``0700``) if it is missing, and check that it, and the
    folder holding it, can be trusted; else ``UnsafeCheckpointError`` naming the folder and what to do.
    ``OSError`` (``shm_dir`` cannot be created or read) propagates for the caller to name."""
    os.makedirs(shm_dir, exist_ok=True)
    parent = os.stat(shm_dir)  # followed: /dev/shm is a symlink to /run/shm on some systems
    if parent.st_uid not in (os.geteuid(), *_TRUSTED_PARENT_UIDS):
        _refuse(shm_dir, f"it is owned by uid {parent.st_uid}, who could replace the namespace inside it")
    if parent.st_mode & _OTHERS_WRITE and not parent.st_mode & stat.S_ISVTX:
        _refuse(shm_dir, f"other users may write it without the sticky bit (mode {stat.S_IMODE(parent.st_mode):04o}), "
                         "so they could replace the namespace inside it")
    try:
        os.mkdir(base, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        if os.path.islink(base):
            _refuse(base, "it is a symbolic link (to someone else's folder, perhaps); it is never followed")
        if os.path.lexists(base) and not os.path.isdir(base):
            _refuse(base, f"it is {_kind(os.lstat(base).st_mode)}, not a folder")
        raise
    try:
        st = os.fstat(fd)
        why = foreign_reason(st, want_dir=True)
        if why is not None and st.st_uid != os.geteuid():
            _refuse(base, why)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # ours, made by an older fastckpt (0755): only this user may look inside from now on
    finally:
        os.close(fd)


def _refuse(path: str, why: str) -> None:
    raise UnsafeCheckpointError(
        f"{path}: refusing to use this shared-memory folder: {why}. Snapshots staged there could be read, "
        "altered or planted by another user. Remove it if it is yours, or set staging.shm_dir to a folder only "
        "you can write")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISREG, "a regular file"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def lock_held(owner_dir: str) -> bool:
    """Whether another process holds the owner's ``alive.lock``. POSIX record locks die with their
    process (SIGKILL included), are not inherited by forked children (DataLoader workers), and
    work across pid namespaces sharing one tmpfs, where pids say nothing."""
    try:
        fd = open_trusted(os.path.join(owner_dir, ALIVE), os.O_RDWR, "owner's lock file")
    except (OSError, UnsafeCheckpointError):
        return False  # no lock file (the owner died before it could stage anything); a foreign one was warned of
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock if we just took it from a dead owner


def open_buffer(path: str, nbytes: int) -> tuple[object, torch.Tensor]:
    """Map an existing staging buffer; never create one (a missing shard must not read as zeros)."""
    fd = open_buffer_fd(path, nbytes, os.O_RDWR)  # mmap maps it shared, readable and writable
    try:
        mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED)
    finally:
        os.close(fd)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def open_buffer_fd(path: str, nbytes: int, mode: int) -> int:
    """Open an existing staging buffer (``mode``: os.O_RDONLY or os.O_RDWR), checked to be a regular file of the
    staged size; never through a symlink."""
    size = max(nbytes, 1)
    try:
        fd = open_trusted(path, mode, "staged buffer")  # a FIFO would block the open (O_RDONLY) or the read
    except OSError as e:
        raise IntegrityError(f"{path}: the staged buffer cannot be opened ({e}); the snapshot is incomplete") from e
    try:
        st = os.fstat(fd)
        if st.st_size != size:
            raise IntegrityError(f"{path}: the staged buffer is not a regular file of {size} bytes "
                                 f"(found {st.st_size}); the snapshot is incomplete or was altered")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_record(path: str) -> bytes | None:
    """The bytes of the record at ``path`` (a regular file of this user's, bounded in size), or None if missing."""
    try:
        fd = open_trusted(path, os.O_RDONLY, "shared-memory record")
    except FileNotFoundError:
        return None
    except OSError as e:
        raise IntegrityError(f"{path}: cannot open the record ({e})") from e
    try:
        st = os.fstat(fd)
        if st.st_size > _MAX_RECORD_BYTES:
            raise IntegrityError(f"{path}: the record is larger than {_MAX_RECORD_BYTES} bytes; it was not written "
                                 "by fastckpt")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(st.st_size)  # bounded by the size checked, even if the file grows meanwhile
    finally:
        os.close(fd)
