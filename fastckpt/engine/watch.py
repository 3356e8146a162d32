"""Watched optimizers: the handle ``Checkpointer.watch`` returns (``remove()`` takes the optimizer's step pre-hook
away again), and the identities of what they own, whose copies may wait until their next step."""
from __future__ import annotations

import weakref
from itertools import chain
from typing import Any, Hashable, Iterable, Sequence

import torch

from ..format.identity import address

__all__ = ["WatchHandle", "Watched", "WatchedCache", "watched_identities"]

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


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})
_ptr = torch._C.TensorBase.data_ptr


class WatchedCache:
    """``watched_identities``, taken again only when the optimizers changed: ``save()`` asks at every call, and
    walking every parameter and state tensor through ``address()`` was a Python call per tensor. The check is C-level
    ``map``s over the same tensors: the optimizers, their parameters' and state values' types, and the parameters'
    and state tensors' data addresses, compared as lists with those of the last walk. Equal: the same ``Watched``
    (the same set objects) is returned. Optimizers holding DTensors or empty tensors (whose identity is not their
    address) are walked every time."""

    def __init__(self) -> None:
        self._key: Any = None
        self._value: Watched | None = None
        self.union: frozenset[Hashable] = frozenset()  # both sets of the last value, as one (the lazy identities)
        self._within: tuple[Any, list[int]] | None = None  # (a state's token, the optimizers' ids): see ``get``

    def get(self, optimizers: Sequence[torch.optim.Optimizer], certified: Any = None) -> Watched:
        """The identities of ``optimizers``' tensors. ``certified``: format/flatcache.py's token of the state being
        saved, which passed the identity check (its tensors at the addresses the token was made with). Where the
        last answer was taken with the same token and optimizers, and every identity in it is one of that state's,
        the answer stands without the walk over the optimizers (0.3 ms of a 588-tensor ``save()`` on the 2-core
        benchmark host): a watched tensor that moved is one of the state's, and a state made anew from the model
        and the optimizer then fails the identity check (a new token). What a reused state cannot show is the
        optimizers' own change (a parameter group added or removed since): a tensor newly watched is then copied
        eagerly, inside ``save()``, until the state changes; one no longer watched stays lazy, its writes before the
        next step found by the seal as any other's."""
        within = self._within
        if (certified is not None and within is not None and within[0] is certified and self._value is not None
                and within[1] == list(map(id, optimizers))):
            return self._value
        key = _fingerprint(optimizers)
        if key is None or key != self._key or self._value is None:
            value = watched_identities(optimizers)
            self._key, self._value, self.union = key, value, frozenset(value[0] | value[1])
        held = certified is not None and key is not None and self.union.issubset(certified.ids)
        self._within = (certified, list(map(id, optimizers))) if held else None
        return self._value


def _fingerprint(optimizers: Sequence[torch.optim.Optimizer]) -> Any:
    """What ``watched_identities`` depends on, as lists; None where an identity is not a data address."""
    out: list[Any] = [list(map(id, optimizers))]
    for opt in optimizers:
        groups = opt.param_groups
        params = groups[0]["params"] if len(groups) == 1 else list(chain.from_iterable(g["params"] for g in groups))
        values = list(chain.from_iterable(map(dict.values, opt.state.values())))
        kinds: Any = len(params)
        if _PLAIN.issuperset(map(type, chain(params, values))):
            # the usual case: plain tensors only, whose identities are their addresses, read in one map; the key is
            # those and where the parameters end (their exact types change no identity)
            ptrs = list(map(_ptr, chain(params, values)))
        else:
            kinds = list(map(type, chain(params, values)))
            if not _PLAIN.issuperset(kinds[:len(params)]):
                return None
            if any(isinstance(v, torch.Tensor) for v in values if type(v) not in _PLAIN):
                return None  # a tensor subclass (DTensor) in the state
            ptrs = list(map(_ptr, chain(params, [v for v in values if type(v) in _PLAIN])))
        if 0 in ptrs:
            return None
        out += [kinds, ptrs]
    return out


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
