"""Reading a checkpoint that is re-saved (or deleted) while it is read.

Saving a name again writes new files (a new uid), replaces the manifest atomically, then
removes the files of the checkpoint it replaced. A reader that read the old manifest can
then find one of its files gone: that is not damage, the checkpoint moved on. So when a
read fails and the manifest changed since the read began, it is read once more from the
new manifest; an unchanged manifest means the failure is real and is raised as it is.
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from ..errors import FastCkptError
from ..format.layout import MANIFEST
from ..storage.protocol import Storage

__all__ = ["read_consistently"]

log = logging.getLogger("fastckpt")

T = TypeVar("T")


def read_consistently(storage: Storage, dirpath: str, read: Callable[[], T]) -> T:
    """Run ``read`` (open a reader of ``dirpath`` and load); once more if the manifest changed meanwhile."""
    mpath = storage.join(dirpath, MANIFEST)
    before = _manifest(storage, mpath)
    try:
        return read()
    except FastCkptError as e:
        after = _manifest(storage, mpath)
        if after == before or after is _UNREADABLE:
            # nothing moved under the reader, or the storage is unreachable now (a second read would
            # only fail on the manifest, hiding the error that says which file failed): raise it as it is
            raise
        log.info("fastckpt: %s was saved again or deleted while being read (%s); reading it again", dirpath, e)
    return read()


_UNREADABLE = object()  # the manifest could not be read (the storage failed), which says nothing about a re-save


def _manifest(storage: Storage, path: str) -> object:
    try:
        return storage.read_bytes(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except FastCkptError:
        return _UNREADABLE
