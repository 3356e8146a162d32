"""Reflink clones of local files (``FICLONE``): a new file that shares an older file's extents, no data written.

On a file system with reflinks (btrfs, XFS with ``reflink=1``) a shard whose tensor bytes a shard of the previous
checkpoint already holds is cloned from it instead of written (``format/clonewrite.py``). A clone is an
independent file: deleting or rewriting the older one never changes it (the file system copies on write). Where
the file system has none (ext4, tmpfs) files are written as before: there ``copy_file_range`` is a real copy and
measured slower than the O_DIRECT write of the staged bytes (BENCHMARKS.md, "Bytes sent per checkpoint: dedup").

Whether a root can clone is probed once per device (``st_dev``) and kept in memory: two small hidden files in the
root, created ``O_EXCL | O_NOFOLLOW`` (a planted link or file at those names is never followed nor removed: the
verdict is then "no"), cloned one into the other, removed after.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
from typing import Callable, Sequence

from .deadline import storage_error

__all__ = ["FICLONE", "PROBE_PREFIX", "clone_patched", "probe_names", "supports_reflink"]

log = logging.getLogger("fastckpt")

FICLONE = 0x40049409  # _IOW(0x94, 9, int): linux/fs.h
PROBE_PREFIX = ".fastckpt-reflink-probe-"
_CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# what the kernel answers where the file system (or the pair of files) cannot share extents
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}

_lock = threading.Lock()
_verdicts: dict[int, bool] = {}  # st_dev -> whether files there can be cloned


def probe_names(root: str) -> tuple[str, str]:
    """The probe's two temporary files in ``root`` (named by pid, so two processes never share them)."""
    base = os.path.join(root, f"{PROBE_PREFIX}{os.getpid()}")
    return base + "-a", base + "-b"


def supports_reflink(root: str) -> bool:
    """Whether files under the local folder ``root`` can be cloned; probed once per device, then cached."""
    try:
        os.makedirs(root, exist_ok=True)
        dev = os.stat(root).st_dev
    except OSError as e:
        log.info("fastckpt: cannot probe %s for reflinks (%s): files are written", root, e)
        return False
    with _lock:
        if dev not in _verdicts:
            _verdicts[dev] = _probe(root)
            log.info("fastckpt: reflinks %s under %s", "supported" if _verdicts[dev] else "not supported", root)
        return _verdicts[dev]


def _probe(root: str) -> bool:
    made: list[str] = []
    fds: list[int] = []
    try:
        a, b = probe_names(root)
        fds.append(os.open(a, os.O_RDWR | _CREATE, 0o600))
        made.append(a)
        os.write(fds[0], b"\0" * 4096)
        fds.append(os.open(b, os.O_RDWR | _CREATE, 0o600))
        made.append(b)
        fcntl.ioctl(fds[1], FICLONE, fds[0])
        return os.fstat(fds[1]).st_size == 4096
    except FileExistsError as e:  # something planted at our names: never followed, never removed
        log.warning("fastckpt: reflink probe refused %s (already exists; not ours): files are written", e.filename)
        return False
    except OSError as e:
        if e.errno not in _NO_CLONE:
            log.info("fastckpt: reflink probe under %s failed (%s): files are written", root, e)
        return False
    finally:
        for fd in fds:
            os.close(fd)
        for path in made:  # only the files this probe created
            try:
                os.unlink(path)
            except OSError:
                pass


def clone_patched(src: str, dst: str, patches: Sequence[tuple[int, memoryview]], size: int, fsync: bool,
                  check: Callable[[bytes], bool]) -> bool:
    """Make ``dst`` (new) a clone of the regular file ``src`` (``size`` bytes), then write each ``(offset, bytes)``
    of ``patches`` over it: only those blocks are written (copy on write). The first patch is the header, at offset
    0: ``check`` gets ``src``'s bytes under it (its old header) and says whether ``src`` is the file the caller
    means. False when ``src`` is gone, not a regular
    file, not ``size`` bytes, refused by ``check`` or cannot be cloned (the caller writes ``dst`` as usual;
    nothing is left at ``dst``); other failures raise ``StorageError`` naming ``dst``."""
    try:
        return _clone(src, dst, patches, size, fsync, check)
    except OSError as e:
        raise storage_error(f"cloning {src!r} (reflink) to", dst, e) from e


def _clone(src: str, dst: str, patches: Sequence[tuple[int, memoryview]], size: int, fsync: bool,
           check: Callable[[bytes], bool]) -> bool:
    try:
        sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:  # gone (retention, a user), or a planted link
        log.info("fastckpt: no reflink source %s (%s): the shard is written", src, e)
        return False
    try:
        st = os.fstat(sfd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            log.info("fastckpt: reflink source %s is not the %d-byte file its manifest lists: the shard is written",
                     src, size)
            return False
        if not check(os.pread(sfd, len(patches[0][1]), 0)):
            log.warning("fastckpt: %s does not match the checksum its manifest lists for the bytes being saved: "
                        "the shard is written, not cloned", src)
            return False
        os.makedirs(os.path.dirname(dst), exist_ok=True)  # the save's folder, if no shard of it was written yet
        try:
            dfd = os.open(dst, os.O_RDWR | _CREATE, 0o644)
        except FileExistsError:  # an earlier attempt of this save (uid-named): never another save's file
            os.unlink(dst)
            dfd = os.open(dst, os.O_RDWR | _CREATE, 0o644)
        try:
            try:
                fcntl.ioctl(dfd, FICLONE, sfd)
            except OSError as e:
                if e.errno not in _NO_CLONE:
                    raise
                log.info("fastckpt: cannot clone %s (%s): the shard is written", src, e)
                os.unlink(dst)
                return False
            for offset, view in patches:
                done = 0
                while done < len(view):
                    done += os.pwrite(dfd, view[done:], offset + done)
            got = os.fstat(dfd).st_size
            if got != size:  # never a shard of the wrong length: written instead
                os.unlink(dst)
                log.warning("fastckpt: clone %s has %d bytes, expected %d: the shard is written", dst, got, size)
                return False
            if fsync:
                os.fsync(dfd)
            return True
        except BaseException:
            try:
                os.unlink(dst)
            except OSError:
                pass
            raise
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)
