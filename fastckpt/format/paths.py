"""Checking names read from disk or shared memory, which are hostile until checked.

Every file name that comes out of a manifest, a meta file, a pointer, a header or a
shared-memory record goes through ``plain_name`` before it is joined to a root, and
every path rebuilt from such a record goes through ``confine``. One checker used
everywhere beats a check in each caller: a ``../..`` entry in a planted manifest must
never make ``load()`` read, ``delete()`` remove, or the uploader send a file outside the
checkpoint.
"""
from __future__ import annotations

import os
import posixpath
import re

from ..errors import ConfigError, UnsafeCheckpointError

__all__ = ["plain_name", "confine", "is_plain_name", "checkpoint_name", "file_name", "file_path"]

_FORBIDDEN = ("/", "\\", "\x00")
_NAME_RE = re.compile(r"^[^/\\\x00]+$")


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is one path component: a non-empty str without separators, NUL, ``.`` or ``..``."""
    return (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in _FORBIDDEN)
            and len(name) <= 255)


def plain_name(name: object, what: str, source: str) -> str:
    """Return ``name`` if it is a plain file name; else raise ``UnsafeCheckpointError`` naming ``source``.

    ``what`` says which field held it ("shard file", "meta file"), ``source`` the file it was read from.
    """
    if not is_plain_name(name):
        raise UnsafeCheckpointError(
            f"{source}: the {what} name {name!r} is not a plain file name (it has a path separator, '..', or is "
            "empty); refusing to touch anything outside the checkpoint. The file was tampered with or is not a "
            "fastckpt file: restore it from a good copy or delete the checkpoint")
    return name  # type: ignore[return-value]


def confine(root: str, path: str, what: str) -> str:
    """Return ``path`` if it lies strictly under ``root`` (lexically, and through symlinks for local paths)."""
    if "://" in root or "://" in path:
        r = root.split("://", 1)[-1].rstrip("/")
        p = posixpath.normpath(path.split("://", 1)[-1])
        inside = p.startswith(r + "/") and ".." not in p.split("/")
    else:
        r = os.path.realpath(root)
        p = os.path.realpath(path)
        inside = p.startswith(r.rstrip(os.sep) + os.sep)
    if not inside:
        raise UnsafeCheckpointError(f"{what} {path!r} lies outside {root!r}; refusing to use it")
    return path


def checkpoint_name(name: object) -> str:
    """A checkpoint name a caller gave (``save(name=...)``, ``load(name=...)``): one file name without a leading
    ``.`` (fastckpt's own temporary and hidden files start with one); else ``ConfigError``."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", "..") or name.startswith("."):
        raise ConfigError(f"checkpoint name {name!r} must be a non-empty file name without '/' or a leading '.'")
    return name


def file_name(name: object) -> str:
    """A framework's file name (``save_file``): any plain name (Lightning's ddp_spawn saves ``.temp.ckpt``), but
    not one of the temporary names ``write_file_atomic`` uses; else ``ConfigError``."""
    if not is_plain_name(name) or ".fastckpt-tmp-" in name:  # type: ignore[operator]
        raise ConfigError(f"file name {name!r} must be one plain file name (no '/', not '.' or '..')")
    return name  # type: ignore[return-value]


def file_path(name: object) -> str:
    """A framework's file name (``save_file``), or one inside a folder of the root (``checkpoint_3/model.safetensors``:
    Accelerate's folders, whose big files the ranks share): each part as ``file_name``; else ``ConfigError``."""
    parts = name.split("/") if isinstance(name, str) else [name]
    if len(parts) > 2:
        raise ConfigError(f"file name {name!r} must be a file name or 'folder/file' (one folder of the root)")
    for part in parts:
        file_name(part)
    return name  # type: ignore[return-value]
