"""``RootClaim``: what a ``Checkpointer`` does before its first write into its root.

It becomes the root's only writer (``lock.py``: refused with an error naming the holder), then removes what dead
writers left (``gc.py``, after ``orphan_grace_s``), never the folders of saves still in flight. With
``distributed=True`` only rank 0 claims, at construction, and every rank learns whether it could.
"""
from __future__ import annotations

from typing import Callable, Iterable

from ..engine.distributed import Coordinator
from ..errors import StorageError
from ..storage.protocol import Storage
from .gc import collect_quietly
from .lock import RootLock

__all__ = ["RootClaim"]


class RootClaim:
    """Claims one root once, on the leader; holds its lock until ``release``."""

    def __init__(self, storage: Storage, *, leader: bool, grace_s: float | None,
                 in_flight: Callable[[], list[str]]) -> None:
        """``in_flight``: the names of saves not yet committed, which garbage collection must not touch."""
        self.storage, self.leader, self.grace_s, self._in_flight = storage, leader, grace_s, in_flight
        self.lock = RootLock.for_root(storage.url) if leader else None  # rank 0 writes for all
        self.claimed = False  # whether this writer wrote (or is about to write) its root
        self.removed_orphans: list[str] = []  # folders of dead saves removed at the first write

    def claim(self, protect: Iterable[str] = ()) -> None:
        """Called before each write (the first one does the work); never removes the folders in ``protect``."""
        if self.claimed or not self.leader:
            return
        if self.lock is not None:
            self.lock.acquire()
        self.claimed = True
        keep = set(protect)
        if self.grace_s is not None:  # under the lock: no live writer can be starting a save in what is removed
            # in place: the Checkpointer hands this very list to its users
            self.removed_orphans[:] = collect_quietly(self.storage, self.grace_s,
                                                      lambda name: name in keep or name in self._in_flight())

    def claim_together(self, coord: Coordinator) -> None:
        """Distributed: rank 0 claims the root at construction, and every rank learns whether it could."""
        failed = None
        try:
            self.claim()
        except StorageError as e:
            failed = e
        verdict = coord.outcome(None if failed is None else str(failed))
        if failed is not None:
            raise failed
        if verdict is not None:
            raise StorageError(f"rank 0: {verdict}")

    def release(self) -> None:
        """Called by ``close()`` after the last commit and retention: the next writer may start."""
        if self.lock is not None:
            self.lock.release()
