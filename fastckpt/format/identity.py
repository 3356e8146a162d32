"""Which tensors are the same tensor: the identities that decide each tensor's copy class (lazy or eager).

``state_dict()`` hands out detached aliases, never the optimizer's own tensor objects, so a tensor is matched by
where its data lives. A non-empty tensor is its data address. An empty one has no address (``data_ptr()`` is 0):
FSDP2 gives a rank an empty block of any parameter whose first dimension is smaller than the number of ranks
(``Linear(32, 1)`` on 2 ranks), and its optimizer state is empty there too. Such a tensor is matched by its storage
object instead, which every alias shares; were it not, that rank alone would plan the DTensor's blocks as eager, and
the ranks' plans would disagree. ``flatten`` finds tied DTensors by the same identity, so a rank whose block of a
tied weight is empty dedups it as the others do.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Hashable

import torch

from ..errors import ConfigError

__all__ = ["address", "address_read", "named_addresses"]


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def address(t: torch.Tensor) -> Hashable:
    """The identity of ``t``'s data; a DTensor's (FSDP2 parameter, its optimizer state) is its local block's."""
    if type(t) not in _PLAIN:  # a save asks thousands of times; a missed getattr costs more than the data_ptr()
        local = getattr(t, "_local_tensor", None)
        if isinstance(local, torch.Tensor):
            t = local
    ptr = t.data_ptr()
    if ptr or t.is_meta:
        return ptr
    # A tuple never equals an int address, so an empty tensor never matches a non-empty one by accident.
    return ("storage", t.untyped_storage()._cdata)


def address_read(t: torch.Tensor, ptr: int) -> Hashable:
    """``address(t)`` where ``ptr`` is ``t.data_ptr()``, already read: a plain tensor's identity is its data address,
    unless empty (``flatten`` reads every tensor's address anyway, and a save walks hundreds)."""
    return ptr if ptr and type(t) in _PLAIN else address(t)


def named_addresses(flat: Any, names: Any, what: str) -> set[Hashable]:
    """Identities of the tensors ``save(eager=/lazy=...)`` names: tensors, or fnmatch patterns of flattened keys."""
    if type(names) is tuple and not names:  # the default, at every save()
        return set()
    if isinstance(names, (str, torch.Tensor)):
        names = [names]
    names = list(names)
    patterns = [e for e in names if isinstance(e, str)]
    found = {address(t) for t in names if isinstance(t, torch.Tensor)}
    bad = [e for e in names if not isinstance(e, (str, torch.Tensor))]
    if bad:
        raise ConfigError(f"save({what}=...) takes tensors or key patterns (str), got {type(bad[0]).__name__}")
    if patterns:
        found.update(address(src) for key, src in zip(flat.keys, flat.lazy_src)
                     if any(fnmatch.fnmatchcase(key, p) for p in patterns))
    return found
