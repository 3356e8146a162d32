"""What runs at ``accelerator.end_training()`` besides the flush: the clean end of a run (``cadence.py``'s record)."""

from __future__ import annotations

import weakref
from typing import Any, Callable

__all__ = ["at_end", "ended"]

_AT_END: "weakref.WeakKeyDictionary[Any, list[Callable[[], None]]]" = weakref.WeakKeyDictionary()


def at_end(checkpointing: Any, fn: Callable[[], None]) -> None:
    """Call ``fn()`` once ``checkpointing`` closed cleanly at ``end_training()``."""
    _AT_END.setdefault(checkpointing, []).append(fn)


def ended(checkpointing: Any) -> None:
    """Called by ``end_training()`` after a clean close."""
    for fn in _AT_END.pop(checkpointing, []):
        fn()
