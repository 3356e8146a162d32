"""``ModelCheckpoint`` versioning that sees saves which have not landed yet.

``ModelCheckpoint(filename="model")`` picks ``model.ckpt``, then ``model-v1.ckpt``... by asking its filesystem whether
a name exists right after the previous save. With asynchronous saves the previous file may still be in flight, and
two checkpoints would share one name. The plugin wraps each ``ModelCheckpoint``'s filesystem so that ``exists`` also
counts this process's pending saves. Only the filesystem is wrapped: Lightning's own ``file_exists`` (and the
collective it uses to agree across ranks) runs unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from fastckpt_lightning import pending


def see_pending_saves(trainer: pl.Trainer) -> None:
    """Called by ``FastCheckpointIO.attach`` (every fit: ``ModelCheckpoint.setup`` replaces its filesystem)."""
    for callback in trainer.checkpoint_callbacks:
        fs = getattr(callback, "_fs", None)
        if isinstance(callback, ModelCheckpoint) and fs is not None and not isinstance(fs, PendingAwareFS):
            callback._fs = PendingAwareFS(fs)


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
