"""``load_state_dict`` pre-hooks that let pending lazy copies finish before a load writes the parameters.

Both integrations make ``model.load_state_dict(...)`` a safe point (a load right after a save would otherwise write
the parameters a pending copy still reads). The hook must survive what users do to models: pickling (Lightning's
``ddp_spawn`` sends the module to its processes, Accelerate's own tests pickle the Accelerator with its models), so
it is a module-level class whose pickled copy is inert (the copy belongs to another process, with no pending copy),
and it holds its target weakly, so a hooked model does not keep the plugin alive.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

from torch import nn
from torch.optim import Optimizer

__all__ = ["WaitBeforeLoad", "guard_loads", "guard_optimizer_loads", "foreign_load_hooks"]


class WaitBeforeLoad:
    """Calls ``wait`` (held weakly when a bound method) before a ``load_state_dict``; inert once pickled."""

    fastckpt_wait = True  # marks the hook as ours: a load that bypasses load_state_dict waits for copies itself

    def __init__(self, wait: Callable[[], None] | None) -> None:
        if wait is None:
            self._ref: Callable[[], Any] = lambda: None
        else:
            self._ref = weakref.WeakMethod(wait) if hasattr(wait, "__self__") else (lambda: wait)

    def __call__(self, *_: Any) -> None:
        fn = self._ref()
        if fn is not None:
            fn()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return WaitBeforeLoad, (None,)


def guard_loads(module: nn.Module, wait: Callable[[], None]) -> list[Any]:
    """Register ``wait`` to run before ``load_state_dict`` writes ``module`` or any submodule (called directly on a
    submodule too); returns the hook handles (``remove()`` each)."""
    hook = WaitBeforeLoad(wait)
    return [m.register_load_state_dict_pre_hook(hook) for m in module.modules()]


def guard_optimizer_loads(optimizer: Optimizer, wait: Callable[[], None]) -> Any:
    """Register ``wait`` to run before ``optimizer.load_state_dict`` writes its state; returns the hook handle.
    torch's own optimizers rebind their state to the loaded tensors (those a pending copy reads stay untouched), but
    one that loads into its preallocated buffers writes them in place."""
    return optimizer.register_load_state_dict_pre_hook(WaitBeforeLoad(wait))


def foreign_load_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has ``load_state_dict`` hooks other than ``WaitBeforeLoad`` (which a fast load that bypasses
    ``load_state_dict`` may ignore: it waits for pending copies itself)."""
    hooks = [*module._load_state_dict_pre_hooks.values(), *module._load_state_dict_post_hooks.values()]
    return any(not getattr(getattr(h, "hook", h), "fastckpt_wait", False) for h in hooks)
