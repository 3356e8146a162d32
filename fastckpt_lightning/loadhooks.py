"""``model.load_state_dict(...)`` waits for pending lazy copies before it writes the parameters.

A load writes every parameter in place; if a lazy copy of a checkpoint just saved still reads them, that checkpoint
would hold the loaded values, or (if the load came after the copy but before the snapshot's seal) be refused as
changed. ModelCheckpoint's own recipe for manual optimization swaps a layer's weights with ``load_state_dict`` around
each save, and user code restores weights the same way. With this pre-hook on every submodule, such a load is a safe
point: the pending snapshots are staged and sealed first, then the load proceeds. The trainer's optimizers get the
same pre-hook: torch's own ``load_state_dict`` rebinds the state (the tensors a copy reads stay untouched), but an
optimizer that loads into its preallocated buffers writes them in place.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

from torch import nn
from torch.optim import Optimizer

from fastckpt.engine.loadwait import guard_loads, guard_optimizer_loads

__all__ = ["LoadGuard", "guard_loads"]


class LoadGuard:
    """The pre-hooks on one module at a time (the Trainer's LightningModule) and its optimizers; ``guard`` again
    moves them."""

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait
        self._handles: list[Any] = []
        self._targets: list[weakref.ref] = []

    def guard(self, module: nn.Module, optimizers: Iterable[Optimizer] = ()) -> None:
        targets = [module, *optimizers]
        if len(targets) == len(self._targets) and all(r() is t for r, t in zip(self._targets, targets)):
            return
        self.remove()
        self._handles = guard_loads(module, self._wait) + [guard_optimizer_loads(o, self._wait) for o in targets[1:]]
        self._targets = [weakref.ref(t) for t in targets]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._targets = [], []
