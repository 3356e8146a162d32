"""``model.load_state_dict(...)`` waits for pending lazy copies before it writes the parameters.

A load writes every parameter in place; if a lazy copy of a checkpoint just saved still reads them, that checkpoint
would hold the loaded values, or (if the load came after the copy but before the snapshot's seal) be refused as
changed. ModelCheckpoint's own recipe for manual optimization swaps a layer's weights with ``load_state_dict`` around
each save, and user code restores weights the same way. With this pre-hook on every submodule, such a load is a safe
point: the pending snapshots are staged and sealed first, then the load proceeds.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

from torch import nn

from fastckpt.engine.loadwait import guard_loads

__all__ = ["LoadGuard", "guard_loads"]


class LoadGuard:
    """The pre-hooks on one module at a time (the Trainer's LightningModule); ``guard`` again moves them."""

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait
        self._handles: list[Any] = []
        self._module: weakref.ref | None = None

    def guard(self, module: nn.Module) -> None:
        if self._module is not None and self._module() is module:
            return
        self.remove()
        self._handles, self._module = guard_loads(module, self._wait), weakref.ref(module)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._module = [], None
