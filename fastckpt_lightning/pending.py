"""Saves still in flight in this process, by path.

``trainer.save_checkpoint(p)`` may return before ``p`` exists. Anything in this process that reads ``p`` next (a
new Trainer's ``fit(ckpt_path=p)``, through any ``FastCheckpointIO`` instance) waits here for that save first, and
``ModelCheckpoint``'s versioning asks here whether a name is taken by a save that has not landed yet.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

from fastckpt import SaveHandle
from fastckpt.errors import FastCkptError, StorageError

_lock = threading.Lock()
_pending: dict[str, SaveHandle] = {}


def _key(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


def add(path: str, handle: SaveHandle) -> None:
    """Called by the plugin right after submitting a save; the entry leaves once the save ends either way."""
    key = _key(path)
    with _lock:
        _pending[key] = handle

    def done(_: object) -> None:
        with _lock:
            if _pending.get(key) is handle:
                del _pending[key]

    handle.durable.add_done_callback(done)


def handles() -> list[SaveHandle]:
    """Every save still in flight in this process (what a logger's deferred ``after_save_checkpoint`` waits for)."""
    with _lock:
        return list(_pending.values())


def handle_of(path: str) -> Optional[SaveHandle]:
    """The handle of the save of ``path`` still in flight in this process, or None."""
    with _lock:
        return _pending.get(_key(path))


def contains(path: str) -> bool:
    """Whether a save of ``path`` is still in flight in this process."""
    with _lock:
        return _key(path) in _pending


def wait_for(path: str) -> None:
    """Block until the pending save of ``path`` (if any) is durable; raise a ``StorageError`` if it failed."""
    with _lock:
        handle = _pending.get(_key(path))
    if handle is None:
        return
    try:
        handle.wait_staged()  # seals a lazy save on this thread: it commits only once sealed
        handle.blocking()
        handle.durable.result()
    except FastCkptError as e:
        raise StorageError(f"cannot load {path!r}: its save in this process failed: {e}") from e
