"""The temporary files of single-file saves, and the marker that proves fastckpt wrote them.

A single-file save (a Lightning ``.ckpt``) is written to ``.NAME.fastckpt-tmp-UID`` next to its target and renamed
into place. Before the first byte of it, fastckpt creates ``.NAME.fastckpt-tmp-UID.fastckpt-mark`` (exclusively,
never through a symlink) holding exactly ``mark_bytes(temp name)``, and removes it after the rename. A name alone
proves nothing (any user may name a file so), so the garbage collector removes a temporary file only when its
marker is there with exactly those bytes, and a lone marker only when its bytes name its own temporary file.
"""
from __future__ import annotations

import json
import re
import secrets

__all__ = ["MARK_SUFFIX", "is_mark_name", "is_temp_name", "mark_bytes", "mark_name", "temp_basename"]

MARK_SUFFIX = ".fastckpt-mark"
MAX_MARK_BYTES = 4096  # a marker is one short JSON line: anything longer is not one
_TEMP = re.compile(r"\..+\.fastckpt-tmp-[0-9A-Za-z_-]+")
_MARK = re.compile(r"(\..+\.fastckpt-tmp-[0-9A-Za-z_-]+)" + re.escape(MARK_SUFFIX))


def temp_basename(base: str, uid: str | None = None) -> str:
    """The temporary name of file ``base``: ``uid`` is the save's (shared by the ranks of one file), else random,
    so nobody can plant an entry under it in advance."""
    return f".{base}.fastckpt-tmp-{uid or secrets.token_hex(8)}"


def mark_name(temp: str) -> str:
    """The marker's path (or name) of the temporary file ``temp``."""
    return temp + MARK_SUFFIX


def mark_bytes(temp_name: str) -> bytes:
    """What fastckpt writes into the marker of the temporary file named ``temp_name`` (a base name)."""
    return json.dumps({"fastckpt": "temporary file of a single-file save", "temp": temp_name}).encode() + b"\n"


def is_temp_name(name: str) -> bool:
    """Whether ``name`` is named like a temporary file (a name proves nothing: see the module docstring)."""
    return bool(_TEMP.fullmatch(name))


def is_mark_name(name: str) -> str | None:
    """The temporary file's name if ``name`` is named like a marker, else None."""
    m = _MARK.fullmatch(name)
    return m.group(1) if m else None
