"""Keep ``Checkpointer.watch`` registered on the optimizers that Accelerate really steps.

``AcceleratedOptimizer`` never calls ``Optimizer.__init__``, so ``register_step_pre_hook`` on it raises;
the hook goes on the inner optimizer (``acc_opt.optimizer``). ``accelerator.prepare`` wraps optimizers
after ``enable()`` may have run, so the set is resolved again at every save: the hook only has to be in
place before the first ``step()`` that follows a save. The inner step is skipped during gradient
accumulation and when the GradScaler finds inf/nan; parameters do not change then, so no wait is needed.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from accelerate.optimizer import AcceleratedOptimizer

from fastckpt import Checkpointer


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under any number of ``AcceleratedOptimizer`` wrappers."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class OptimizerWatcher:
    """Watches each optimizer once per Checkpointer; forgets optimizers that were garbage collected."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._checkpointer = checkpointer
        # id(optimizer) -> (weak reference, watch handle); the weak reference detects id reuse.
        self._watched: dict[int, tuple[weakref.ref, Any]] = {}

    def sync(self, optimizers: Iterable[Any]) -> None:
        """Called by the save path before every ``Checkpointer.save``: watch any optimizer not yet watched."""
        for optimizer in optimizers:
            inner = inner_optimizer(optimizer)
            entry = self._watched.get(id(inner))
            if entry is not None and entry[0]() is inner:
                continue
            self._watched[id(inner)] = (weakref.ref(inner), self._checkpointer.watch(inner))

    def remove(self) -> None:
        """Called at close: remove every step pre-hook this watcher installed."""
        for ref, handle in self._watched.values():
            if ref() is not None:
                handle.remove()
        self._watched.clear()
