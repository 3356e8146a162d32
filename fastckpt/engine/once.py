"""Warnings a user reads once per process, on rank 0 only (``WARNED``): shared by pace and priority, below both.

A leaf (it imports no other module of the engine), so that the modules that warn (``pace``: persistence falling
behind, a save with nothing lazy, a retaken snapshot; ``priority``: the threads raised because a save is behind)
share it without importing each other.
"""
from __future__ import annotations

import os
import threading

__all__ = ["OncePerProcess", "WARNED"]


class OncePerProcess:
    """Warnings said once per process (not per ``Checkpointer``: Lightning builds one per folder), and only on
    rank 0 (every DDP rank falls behind together; one line says it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: set[str] = set()

    def first(self, kind: str) -> bool:
        """Whether the warning ``kind`` is due now: True once per process, on rank 0 only."""
        if _rank() != 0:
            return False
        with self._lock:
            if kind in self._said:
                return False
            self._said.add(kind)
            return True

    def reset(self) -> None:
        """Forget what was said (tests)."""
        with self._lock:
            self._said.clear()


WARNED = OncePerProcess()


def _rank() -> int:
    """This process's global rank: torch.distributed's once initialized, else the launcher's ``RANK`` (torchrun,
    Lightning, Accelerate set it before the process group exists), else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
