"""Find the Trainer that is calling the plugin.

Lightning gives a ``CheckpointIO`` no reference to the trainer, yet lazy snapshots need one: the companion callback
must sit in ``trainer.callbacks`` (to wait before ``optimizer.step``) and the core must learn which optimizer tensors
only change inside ``step()``. ``Trainer.save_checkpoint`` is always on the stack when the plugin saves, so the first
save looks for it there. Users who prefer explicit wiring call ``plugin.attach(trainer)`` or add ``plugin.callback``.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import lightning.pytorch as pl

# Trainer.save_checkpoint -> Strategy.save_checkpoint -> plugin.save_checkpoint, plus wrappers users may add.
_MAX_DEPTH = 16


def find_calling_trainer(plugin: Any) -> Optional[pl.Trainer]:
    """The Trainer on the current call stack whose strategy uses ``plugin``, or None (Fabric, direct calls)."""
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        for name in ("self", "trainer"):
            candidate = frame.f_locals.get(name)
            if isinstance(candidate, pl.Trainer) and _uses(candidate, plugin):
                return candidate
        frame = frame.f_back
    return None


def scheduled_by_lightning() -> bool:
    """Whether the save on the stack was made by a ``ModelCheckpoint`` (Lightning's own schedule: it may stay
    asynchronous) rather than by the user's code (a callback's or a script's ``trainer.save_checkpoint``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return False
        if frame.f_code is _TRAINER_SAVE:
            caller = frame.f_back
            # A Trainer subclass's save_checkpoint calling super(): its caller is the one that asked.
            while caller is not None and isinstance(caller.f_locals.get("self"), pl.Trainer):
                caller = caller.f_back
            return caller is not None and isinstance(caller.f_locals.get("self"), ModelCheckpoint)
        frame = frame.f_back
    return False


_TRAINER_SAVE = pl.Trainer.save_checkpoint.__code__


def _uses(trainer: pl.Trainer, plugin: Any) -> bool:
    # Read the private slot: the public property swaps in a default plugin inside wrapping plugins.
    return getattr(trainer.strategy, "_checkpoint_io", None) is plugin


def wrapped_by_async_io(plugin: Any) -> bool:
    """Whether ``plugin`` is being called by Lightning's ``AsyncCheckpointIO`` (from its worker thread)."""
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO

    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return False
        candidate = frame.f_locals.get("self")  # the worker's closure sees AsyncCheckpointIO as a free variable
        if isinstance(candidate, AsyncCheckpointIO) and getattr(candidate, "_checkpoint_io", None) is plugin:
            return True
        frame = frame.f_back
    return False
