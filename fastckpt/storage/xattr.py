"""Extended attributes of local files: a small record that travels with a file's inode, unseen by any listing.

A torch file's health record (fastckpt/format/health.py) is kept here, so that a Lightning folder holds exactly the
files stock Lightning writes. ``attrs_for`` hands the record to ``LocalStorage.write_file_atomic``, which sets it on
the unnamed file before linking it in (the record appears with the file, never after it). A file system that refuses
``user.*`` attributes (tmpfs before Linux 6.6, some network mounts, a full attribute block) gets no record: its files'
health is unknown, said once in the log, and the checkpoint is written all the same.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

__all__ = ["set_attrs", "get_attr", "attrs_for", "take_attrs", "Given"]

log = logging.getLogger("fastckpt")

# The file system does not keep user attributes here (or not this many bytes of them): nothing recorded.
_REFUSED = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.ENOSPC, errno.E2BIG, errno.EACCES}
_ABSENT = {errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP}
_told: set[int] = set()  # the errnos already logged: once per process, not once per checkpoint
_lock = threading.Lock()
_pending: dict[str, "Given"] = {}


@dataclass
class Given:
    """What became of the attributes handed to the next write of a path (``attrs_for``)."""

    attrs: dict[str, bytes]
    tried: bool = False  # a LocalStorage write took them (set, or refused by the file system)


def set_attrs(target: int | str, attrs: dict[str, bytes]) -> bool:
    """Set ``attrs`` on ``target`` (an open descriptor or a path); False, logged once, when they could not be set.
    Never raises: a checkpoint is not lost for want of its health record."""
    for name, value in attrs.items():
        try:
            os.setxattr(target, name, value)  # an int: fsetxattr(2) on the descriptor
        except OSError as e:
            _tell(e, target)
            return False
    return True


def _tell(e: OSError, target: int | str) -> None:
    with _lock:
        first = e.errno not in _told
        _told.add(e.errno)
    if not first:
        return
    where = f"descriptor {target}" if isinstance(target, int) else repr(target)
    if e.errno in _REFUSED:
        log.info("fastckpt: the file system of %s keeps no user extended attributes (%s): checkpoint files written "
                 "there have no health record (health unknown, '-')", where, os.strerror(e.errno or 0))
    else:
        log.warning("fastckpt: could not record the health of %s in an extended attribute (%s): health unknown",
                    where, e)


def get_attr(path: str, name: str) -> bytes | None:
    """The attribute ``name`` of the file at ``path`` (a symlink followed), or None when it has none or its file
    system keeps none. Raises ``FileNotFoundError`` when the file is absent."""
    try:
        return os.getxattr(path, name)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in _ABSENT:
            return None
        raise


@contextmanager
def attrs_for(path: str, attrs: dict[str, bytes]) -> Iterator[Given]:
    """Within the block, the next ``LocalStorage.write_file_atomic`` of ``path`` (through any wrapper storage, on any
    thread) sets ``attrs`` on the file before it takes its name; ``Given.tried`` says whether one did."""
    given = Given(dict(attrs))
    with _lock:
        _pending[path] = given
    try:
        yield given
    finally:
        with _lock:
            if _pending.get(path) is given:
                del _pending[path]


def take_attrs(path: str) -> dict[str, bytes] | None:
    """Called by ``LocalStorage.write_file_atomic``: the attributes handed for ``path``, marked as taken."""
    with _lock:
        given = _pending.pop(path, None)
    if given is None:
        return None
    given.tried = True
    return given.attrs
