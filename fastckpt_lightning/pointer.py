"""Pointer files: the one small object that Lightning sees at ``dirpath/epoch=0-step=10.ckpt``.

The checkpoint data lives in core checkpoint folders next to it (``epoch=0-step=10.ckpt.<token>.fastckpt/``). The
pointer is written only after those folders are committed, so ``fs.exists(path)`` means "loadable", and it is a
single object so s3fs ``modified()``/``ls()`` behave (they raise or mislead on prefixes).

A pointer lists ``parts``: data folder names relative to the pointer's folder. Loading reads them in order and later
parts override top-level keys; this is how ``save_last`` reuses the weights of the checkpoint saved at the same step.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
from dataclasses import dataclass
from typing import Any, Optional

from fastckpt import Storage, open_storage
from fastckpt.errors import IntegrityError, StorageError
from fastckpt.paths import plain_name

log = logging.getLogger("fastckpt")

FORMAT = "fastckpt-lightning-pointer"
VERSION = 1
# Anything larger is a real torch checkpoint (or something else), never one of our pointers.
MAX_POINTER_BYTES = 64 * 1024
# Data folders end with this; they are never pointers.
DATA_SUFFIX = ".fastckpt"


@dataclass(frozen=True)
class Pointer:
    """What a Lightning checkpoint path refers to."""

    parts: tuple[str, ...]
    """Core checkpoint folder names, relative to the pointer's folder; later parts override top-level keys."""
    step: int
    """The global step the checkpoint was taken at (informational)."""

    def to_bytes(self) -> bytes:
        """Serialize as a small JSON document."""
        body = {"format": FORMAT, "version": VERSION, "parts": list(self.parts), "step": self.step}
        return json.dumps(body, indent=1).encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "pointer") -> Optional[Pointer]:
        """Parse a pointer, or return None if ``data`` is anything else (a torch file, a stray JSON).

        A pointer's parts are joined to its folder to load and to *delete* data, so each must be a plain
        folder name: a part such as ``../elsewhere/step-7`` raises ``UnsafeCheckpointError`` naming ``source``.
        """
        if len(data) > MAX_POINTER_BYTES or not data.lstrip().startswith(b"{"):
            return None
        try:
            body = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            return None
        if body.get("version") != VERSION:
            raise StorageError(f"pointer version {body.get('version')!r} is not supported (expected {VERSION})")
        parts, step = body.get("parts"), body.get("step", 0)
        if not isinstance(parts, list) or type(step) is not int:
            raise IntegrityError(f"{source}: malformed pointer (parts {parts!r:.80}, step {step!r:.20}); delete it or "
                                 "restore it from a good copy")
        return cls(parts=tuple(plain_name(p, "data folder", source) for p in parts), step=step)


def split_path(path: str) -> tuple[str, str]:
    """Split a local path or URL into (folder, file name), keeping the URL's protocol on the folder."""
    if "://" in path:
        folder, name = posixpath.split(path.rstrip("/"))
        return folder, name
    folder, name = os.path.split(os.path.abspath(path))
    return folder, name


def join_path(folder: str, name: str) -> str:
    """Inverse of :func:`split_path`."""
    return posixpath.join(folder, name) if "://" in folder else os.path.join(folder, name)


class PointerStore:
    """Reads and writes the pointer files of one checkpoint folder through the core ``Storage``."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self.folder = storage.url

    def write(self, name: str, pointer: Pointer) -> None:
        """Atomically publish ``pointer`` at ``folder/name``, replacing any older one. Called by the publisher."""
        # The core commits its own manifests this way: a rename locally, one PUT on object stores.
        self._storage.write_atomic(self._path(name), pointer.to_bytes())

    def read(self, name: str) -> Optional[Pointer]:
        """The pointer at ``folder/name``; None if the file is missing or is not a pointer."""
        path = self._path(name)
        try:
            if self._storage.size(path) > MAX_POINTER_BYTES:
                return None
            return Pointer.from_bytes(self._storage.read_bytes(path), path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            # Deleted between a listing and the read (a rotation in progress), or a folder: not a pointer.
            return None
        except StorageError as e:
            if getattr(e, "errno", None) in (errno.EISDIR, errno.ENOTDIR):
                return None  # the local storage wraps "is a directory" (a core checkpoint folder)
            raise

    def delete(self, name: str) -> None:
        """Delete the file ``folder/name`` (a pointer or a legacy single-file checkpoint); missing is fine."""
        self._storage.delete(self._path(name))

    def referenced_parts(self) -> set[str]:
        """Every data folder named by some pointer in this folder. Called before deleting data."""
        referenced: set[str] = set()
        for name in self._storage.listdir(self.folder):
            if name.endswith(DATA_SUFFIX) or name.startswith("."):
                continue  # data folders and temporary files are never pointers
            try:
                pointer = self.read(name)
            except StorageError:
                continue  # a sub-folder or an unreadable stray file: it names no data
            except IntegrityError as e:
                log.warning("fastckpt: ignoring pointer %s: %s", name, e)  # a crafted one names no data of ours
                continue
            if pointer is not None:
                referenced.update(pointer.parts)
        return referenced

    def _path(self, name: str) -> str:
        return self._storage.join(self.folder, name)


def read_pointer(path: str, storage_options: Optional[dict[str, Any]] = None) -> Optional[Pointer]:
    """The pointer at ``path`` (local path or URL); None if missing or not a pointer."""
    folder, name = split_path(path)
    return PointerStore(open_storage(folder, storage_options)).read(name)


