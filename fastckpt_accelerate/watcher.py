"""Keep ``Checkpointer.watch`` registered on the optimizers that Accelerate really steps.

``AcceleratedOptimizer`` never calls ``Optimizer.__init__``, so ``register_step_pre_hook`` on it raises;
the hook goes on the inner optimizer (``acc_opt.optimizer``). ``accelerator.prepare`` wraps optimizers
after ``enable()`` may have run, so the set is resolved again at every save: the hook only has to be in
place before the first ``step()`` that follows a save. The inner step is skipped during gradient
accumulation and when the GradScaler finds inf/nan; parameters do not change then, so no wait is needed.

The prepared models get a ``load_state_dict`` pre-hook on every submodule too: a load right after ``save_state()``
(Accelerate's own tests load random weights, then ``load_state()``) first lets the pending lazy copies finish and
seals them, so the checkpoint holds the values of ``save_state()``, not the loaded ones. The inner optimizers get
one as well: torch's own ``load_state_dict`` rebinds the state (the saved tensors stay untouched), but optimizers
with preallocated buffers load into the tensors a pending copy still reads.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from accelerate.optimizer import AcceleratedOptimizer

from fastckpt import Checkpointer
from fastckpt.engine.loadwait import guard_loads, guard_optimizer_loads


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under any number of ``AcceleratedOptimizer`` wrappers."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class OptimizerWatcher:
    """Watches each optimizer once per Checkpointer; forgets optimizers that were garbage collected."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._checkpointer = checkpointer
        # id(optimizer) -> (weak reference, [watch handle, load pre-hook]); the weak reference detects id reuse.
        self._watched: dict[int, tuple[weakref.ref, list[Any]]] = {}
        self._guarded: dict[int, tuple[weakref.ref, list[Any]]] = {}  # id(model) -> its load pre-hooks

    def sync(self, optimizers: Iterable[Any], models: Iterable[torch.nn.Module] = ()) -> None:
        """Called by the save path before every ``Checkpointer.save``: watch any optimizer not yet watched, and
        make every model's and optimizer's ``load_state_dict`` wait for pending copies first."""
        for model in models:
            entry = self._guarded.get(id(model))
            if entry is not None and entry[0]() is model:
                continue
            # the hooks hold this watcher weakly and are inert in a pickled copy (fastckpt/engine/loadwait.py)
            self._guarded[id(model)] = (weakref.ref(model), guard_loads(model, self._wait_before_load))
        for optimizer in optimizers:
            inner = inner_optimizer(optimizer)
            entry = self._watched.get(id(inner))
            if entry is not None and entry[0]() is inner:
                continue
            load_hook = guard_optimizer_loads(inner, self._wait_before_load)
            self._watched[id(inner)] = (weakref.ref(inner), [self._checkpointer.watch(inner), load_hook])

    def _wait_before_load(self) -> None:
        self._checkpointer.wait_staged()

    def remove(self) -> None:
        """Called at close: remove every step and load pre-hook this watcher installed."""
        for ref, handles in self._watched.values():
            if ref() is not None:
                for h in handles:
                    h.remove()
        self._watched.clear()
        for _, handles in self._guarded.values():
            for h in handles:
                h.remove()
        self._guarded.clear()


def close_all(checkpointers: dict[str, Checkpointer], watchers: dict[str, Any]) -> BaseException | None:
    """Flush and close every folder's ``Checkpointer`` (removing its optimizer watcher), all of them even when one
    fails: the first failure is returned for the caller to raise once it has finished closing."""
    first: BaseException | None = None
    for folder, ckpt in list(checkpointers.items()):
        try:
            ckpt.wait()
        except BaseException as e:  # keep closing the others; report the first failure
            first = first or e
        finally:
            watchers.pop(folder).remove()
            ckpt.close()
    return first

