"""The handle ``Checkpointer.watch`` returns: ``remove()`` takes the optimizer's step pre-hook away again."""
from __future__ import annotations

import weakref
from typing import Any

__all__ = ["WatchHandle"]


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
