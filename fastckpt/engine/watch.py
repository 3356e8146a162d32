"""Watched optimizers: the handle ``Checkpointer.watch`` returns (``remove()`` takes the optimizer's step pre-hook
away again), and the identities of what they own, whose copies may wait until their next step."""
from __future__ import annotations

import weakref
from typing import Any, Hashable, Iterable

import torch

from ..format.identity import address

__all__ = ["WatchHandle", "Watched", "watched_identities"]

Watched = tuple[set[Hashable], set[Hashable]]  # (parameters, optimizer state), as ``watched_identities`` gives them


def watched_identities(optimizers: Iterable[torch.optim.Optimizer]) -> Watched:
    """The identities (``fastckpt.format.identity``) of ``optimizers``' parameters and of their state tensors, apart
    (the stale-save check tells the two kinds apart); taken once a save, on the training thread."""
    # Addresses, not tensor objects: state_dict() hands out detached aliases. A tensor is
    # lazy only if it starts exactly where a watched param/state tensor starts (an empty one: same storage).
    params: set[Hashable] = set()
    state: set[Hashable] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            params.update(address(p) for p in group["params"])
        for st in opt.state.values():
            state.update(address(v) for v in st.values() if isinstance(v, torch.Tensor))
    return params - {0}, state - {0}


class WatchHandle:
    """Returned by ``watch``; ``remove()`` stops watching the optimizer."""

    def __init__(self, owner: Any, optimizer: Any, hook: Any) -> None:
        self._owner = weakref.ref(owner)
        self._optimizer = weakref.ref(optimizer)
        self._hook = hook

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        owner, opt = self._owner(), self._optimizer()
        if owner is not None and opt is not None:
            owner.unwatch(opt)
