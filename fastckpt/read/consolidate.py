"""Consolidate a sharded checkpoint: every DTensor's blocks reassembled into one full tensor (world size 1).

``fastckpt export --to torch`` calls this, then writes the result as one torch file. It runs in one process
with no ``torch.distributed``: the blocks of every rank are read and put in place, so it needs the full
state in memory once (the cost a single-file export has anyway).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ..format import dtensor as dt
from ..errors import StateMismatchError
from .loader import load_checkpoint

__all__ = ["consolidate"]


def consolidate(path: str, *, storage_options: dict | None = None, verify: bool = True,
                allowed_classes: Iterable[str] = ()) -> Any:
    """The state saved in checkpoint directory ``path`` with full plain CPU tensors in place of sharded ones.

    Blocks are checked against their checksums as they are read (``verify``); a missing or corrupt block raises
    ``IntegrityError`` naming the file and the tensor.
    """
    state = load_checkpoint(path, map_location="cpu", storage_options=storage_options, verify=verify,
                            allowed_classes=allowed_classes)
    _check_plain(state, path)
    return state


def _check_plain(state: Any, path: str) -> None:
    # The loader already reassembles blocks; this guards the promise the CLI relies on (torch.save of the
    # result must not need torch.distributed to load).
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor) and (dt.is_dtensor(item) or item.is_meta):
            raise StateMismatchError(f"consolidating {path}: a tensor came back as {type(item).__name__} "
                                     f"({item.device}); report this as a bug")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
