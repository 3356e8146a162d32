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

__all__ = ["LoadGuard", "guard_loads"]


def guard_loads(module: nn.Module, wait: Callable[[], None]) -> list[Any]:
    """Register ``wait`` to run before ``load_state_dict`` writes ``module`` or any submodule (called directly on a
    submodule too); returns the hook handles (``remove()`` each). ``wait`` is held weakly when it is a bound method,
    so the hooks do not keep the plugin alive."""
    ref = weakref.WeakMethod(wait) if hasattr(wait, "__self__") else (lambda: wait)

    def before_load(*_: Any) -> None:
        fn = ref()
        if fn is not None:
            fn()

    return [m.register_load_state_dict_pre_hook(before_load) for m in module.modules()]


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
