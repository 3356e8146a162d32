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
