"""``ModelCheckpoint`` versioning that sees saves which have not landed yet.

``ModelCheckpoint(filename="model")`` picks ``model.ckpt``, then ``model-v1.ckpt``... by asking ``file_exists`` right
after the previous save. With asynchronous saves the previous file may still be in flight, and two checkpoints would
share one name. The plugin gives each ``ModelCheckpoint`` of its trainer an ``file_exists`` that also counts this
process's pending saves; the decision is still made on rank 0 and broadcast, as Lightning does.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from fastckpt_lightning import pending

_MARK = "_fastckpt_sees_pending"


def see_pending_saves(trainer: pl.Trainer) -> None:
    """Called by ``FastCheckpointIO.attach``: idempotent, per ``ModelCheckpoint`` instance."""
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint) and not getattr(callback, _MARK, False):
            _patch(callback)


def _patch(callback: ModelCheckpoint) -> None:
    callback.file_exists = _FileExists(callback)  # type: ignore[method-assign]
    setattr(callback, _MARK, True)


class _FileExists:
    """Lightning's own check (rank 0 decides, everyone follows), plus this process's saves still in flight.

    A module-level class rather than a closure: trainers and their callbacks are pickled (``ddp_spawn``)."""

    def __init__(self, callback: ModelCheckpoint) -> None:
        self.callback = callback

    def __call__(self, filepath: Any, trainer: pl.Trainer) -> bool:
        local = False
        if trainer.is_global_zero:
            local = self.callback._fs.exists(filepath) or pending.contains(os.fspath(filepath))
        return trainer.strategy.broadcast(local)
