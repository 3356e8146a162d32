"""Pointer files: how fastckpt 0.1's Lightning plugin laid out a checkpoint (read-only support).

That layout kept a small JSON document at ``dirpath/epoch=0-step=10.ckpt`` naming core checkpoint folders next to
it (``epoch=0-step=10.ckpt.<token>.fastckpt/``); loading read the parts in order, later parts overriding top-level
keys. The plugin now writes genuine torch files; these readers keep old runs resumable.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
from dataclasses import dataclass
from typing import Any, Optional

from fastckpt import Storage, open_storage
from fastckpt.errors import IntegrityError, StorageError
from fastckpt.format.paths import plain_name

FORMAT = "fastckpt-lightning-pointer"
VERSION = 1
# Anything larger is a real torch checkpoint (or something else), never one of our pointers.
MAX_POINTER_BYTES = 64 * 1024


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
    """Reads the pointer files of one checkpoint folder (fastckpt 0.1's layout) through the core ``Storage``."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self.folder = storage.url

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

    def _path(self, name: str) -> str:
        return self._storage.join(self.folder, name)


def read_pointer(path: str, storage_options: Optional[dict[str, Any]] = None) -> Optional[Pointer]:
    """The pointer at ``path`` (local path or URL); None if missing or not a pointer."""
    folder, name = split_path(path)
    return PointerStore(open_storage(folder, storage_options)).read(name)


