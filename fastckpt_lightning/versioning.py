"""``ModelCheckpoint`` that sees saves which have not landed yet: its versioning and its ``last.ckpt`` link.

``ModelCheckpoint(filename="model")`` picks ``model.ckpt``, then ``model-v1.ckpt``... by asking its filesystem whether
a name exists right after the previous save. With asynchronous saves the previous file may still be in flight, and
two checkpoints would share one name. The plugin wraps each ``ModelCheckpoint``'s filesystem so that ``exists`` also
counts this process's pending saves. Only the filesystem is wrapped: Lightning's own ``file_exists`` (and the
collective it uses to agree across ranks) runs unchanged.

``save_last="link"`` points ``last.ckpt`` at the file just saved. Linked at once, it would name a file still in flight
(a crash then leaves a dangling ``last.ckpt``, and ``ckpt_path="last"`` trains from scratch): the link moves once the
file has landed, and keeps naming the previous complete file until then.
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from fastckpt_lightning import pending


def see_pending_saves(trainer: pl.Trainer) -> None:
    """Called by ``FastCheckpointIO.attach`` (every fit: ``ModelCheckpoint.setup`` replaces its filesystem)."""
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        fs = getattr(callback, "_fs", None)
        if fs is not None and not isinstance(fs, PendingAwareFS):
            callback._fs = PendingAwareFS(fs)
        if not isinstance(vars(callback).get("_link_checkpoint"), LinkWhenLanded):
            callback._link_checkpoint = LinkWhenLanded()  # shadows the static method, for this instance only


class PendingAwareFS:
    """An fsspec filesystem whose ``exists`` is also true for a path this process is still saving.

    A module-level class rather than a closure: trainers and their callbacks are pickled (``ddp_spawn``)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    def exists(self, path: Any, **kwargs: Any) -> bool:
        return bool(self.fs.exists(path, **kwargs)) or pending.contains(os.fspath(path))

    def __getattr__(self, name: str) -> Any:
        if name == "fs":  # unpickling: before __init__ ran
            raise AttributeError(name)
        return getattr(self.fs, name)


class LinkWhenLanded:
    """``ModelCheckpoint._link_checkpoint`` that moves the link once its target has landed (module level: pickled).

    The link only moves forward: each request is numbered, and a target that lands after a later request's target
    was linked is not linked (a save that lands late would otherwise point ``last.ckpt`` back at an older file,
    which top-k may have removed since: a dangling link, seen about once in 30 runs of
    tests/test_lightning_fidelity.py::test_save_last_link_names_only_landed_files)."""

    def __init__(self) -> None:
        self._state()

    def _state(self) -> None:
        self._lock = threading.Lock()
        self._asked: dict[str, int] = {}  # link path -> number of the last request
        self._linked: dict[str, int] = {}  # link path -> number of the request it names

    def __getstate__(self) -> dict[str, Any]:
        return {}  # a lock does not pickle; a fresh process starts with no requests

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._state()

    def __call__(self, trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        key = os.fspath(linkpath)
        with self._lock:
            number = self._asked[key] = self._asked.get(key, 0) + 1
        handle = pending.handle_of(os.fspath(filepath)) if trainer.is_global_zero else None
        if handle is None:
            if trainer.is_global_zero:  # the stock method's work, then its barrier, outside the lock
                self._link(_RANK_ZERO_ALONE, filepath, linkpath, number)
            trainer.strategy.barrier()
            return

        def link(done: Any) -> None:  # on the committer thread
            if done.durable.exception() is None:
                self._link(_RANK_ZERO_ALONE, filepath, linkpath, number)

        handle.add_done_callback(link)
        trainer.strategy.barrier()  # what the stock method does on every rank

    def _link(self, trainer: Any, filepath: str, linkpath: str, number: int) -> None:
        """Link (``trainer``: rank zero alone, no barrier) unless a later request's target is linked already."""
        key = os.fspath(linkpath)
        with self._lock:
            if number < self._linked.get(key, 0):
                return
            self._linked[key] = number
            ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)


# Stock linking (remove the old link, symlink, or copy where symlinks are refused) minus its barrier, which the ranks
# passed when the save was made.
_RANK_ZERO_ALONE = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda: None))
