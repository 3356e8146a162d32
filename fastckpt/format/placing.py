"""The last steps of a made local folder's commit, each yielding to a user's removal under way in this process.

Python's ``rmtree`` keeps a folder open from its listing to right before its ``rmdir``: a name appearing or
vanishing under it in between fails that removal ("Directory not empty", ``FileNotFoundError``). The marker's
removal (``unmark``) and a staged folder's rename into place (``rename_into_place``, ``complete_folders``) therefore
run only while no descriptor of this process holds the folder (or, for the rename, a folder above it) open; the
check and the change run as one step for every other Python thread (``storage.heldlink``). A folder held open longer
than the patience is a reader, not a removal: the step goes ahead then.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Sequence

from ..errors import FolderRemovedError, StorageError
from ..storage.heldlink import guards_of, present, remove_unwalked, rename_unwalked, wait_unwalked
from ..storage.local import fsync_dir
from .layout import MANIFEST, FileRecord

__all__ = ["NotPlaced", "PENDING", "rename_into_place", "unmark"]

PENDING = ".fastckpt-pending"


class NotPlaced(StorageError):
    """A staged folder's rename failed for another reason than a removal: raised as it is, not as the user's removal
    (the staging folder, its marker gone, would look removed)."""


def unmark(storage: Any, dirpath: str, made_local: bool) -> None:
    """Remove ``dirpath``'s marker once its manifest is there. In a made local folder (``made_local``), only while no
    walk of this process holds the folder open: a user's ``rmtree`` that listed the folder after the links lists the
    marker too, and unlinking it under that walk would fail it (``FileNotFoundError``); the walk removes the marker
    itself, and finding it gone is fine. A folder held open longer than ``wait_unwalked``'s patience (a reader, not a
    removal) does not keep the marker: it goes then, as the links do."""
    marker = storage.join(dirpath, PENDING)
    if not made_local:
        storage.delete(marker)
        return
    real = os.path.realpath(dirpath)
    # The folder itself only: a walk lists it only while holding it open (one of a folder above it holding that one
    # open has not listed this folder yet, or has and holds this one too). Made before the wait, which returns with
    # the GIL held since its last look: nothing between that look and the unlink lets it go.
    guard = frozenset([os.fsencode(real)])
    wait_unwalked(real)
    if not remove_unwalked(marker, guard):
        storage.delete(marker)  # held open past the patience: a reader, not a removal


def rename_into_place(storage: Any, dirpath: str, publish_as: str, name: str, records: Sequence[FileRecord],
                      patience_s: float = 1.0) -> None:
    """A staged folder ``dirpath``, committed inside its staging name: rename it to its own name ``publish_as``.
    Like the links, only while no thread of this process holds the parent or a folder above it open (a user's
    ``rmtree`` of the project listed it: a name vanishing or appearing under it would fail that removal), right after
    a check that every file is still there, the check and the rename as one step; after ``patience_s`` of a folder
    held open by something else it goes ahead. The staging folder gone (the user's removal): ``FolderRemovedError``."""
    guards = guards_of(dirpath) | guards_of(publish_as)
    names = [r.name for r in records] + [MANIFEST]
    deadline = time.monotonic() + patience_s
    while True:
        try:
            for member in names:
                if not present(os.path.join(dirpath, member)):
                    raise FileNotFoundError(os.path.join(dirpath, member))
            if rename_unwalked(dirpath, publish_as, guards if time.monotonic() < deadline else ()):
                break
        except FileNotFoundError as e:  # the staging folder (or its parent) went: the user's removal wins
            raise FolderRemovedError(f"{os.path.dirname(publish_as)} was removed while its checkpoint {name!r} was "
                                     "being written; the save is abandoned and nothing is recreated there") from e
        except OSError as e:
            raise NotPlaced(
                f"checkpoint {name!r} is complete in {dirpath}, but it cannot take its name {publish_as} "
                f"({e.strerror}): with complete_folders the folder must not exist before its save commits (write "
                "into it only after accelerator.wait_for_everyone()); move the staged folder there by hand to keep "
                "this checkpoint") from e
        time.sleep(0.001)  # lets the walker's thread run (it needs the GIL) and finish
    if getattr(storage, "fsync", False):  # a local storage (or a wrapper of one): the rename made durable
        with contextlib.suppress(FileNotFoundError):  # removed right after: the user's removal, nothing to keep
            fsync_dir(os.path.dirname(publish_as))

