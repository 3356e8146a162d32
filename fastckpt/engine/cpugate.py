"""How many background threads may burn CPU at once: the cores training leaves over, the copy thread first.

Persisting a checkpoint costs CPU beyond its I/O: the lazy copy (one memcpy of the state), the health statistics and
checksums (one blocked pass, format/healthpass.py), the content hashes, and the kernel's copy of every buffered
write into the page cache. Each of these runs on a background thread, and with ``persist.workers`` I/O threads plus
the copy thread, up to three of them could run at once. On a host whose training already keeps some cores busy, the
extra ones take those cores from training: in the Accelerate loop (2 CPUs, one training thread) two I/O workers
checksumming and writing side by side beside the copy thread slowed the two steps after each save by 0.7 s each
(stall 2.09 s per checkpoint, against 0.35 s with one worker; BENCHMARKS.md, "Where the stall goes"). One worker
would also have serialized the waits of the I/O itself (an O_DIRECT write, an fsync, an upload use no CPU), and
``persist.workers`` also sizes the parallel reads of a load. So the I/O threads stay, and only their CPU-bound
sections pass this gate, at most ``limit`` at a time.

``limit`` (``persist.cpu_threads``): ``auto`` is the CPUs this process may use (its affinity) minus those training
uses: ``torch.get_num_threads()`` intra-op threads when the state is on the CPU, one launching thread when it is on
a GPU; never less than one. The copy thread asks as ``urgent``: the next ``optimizer.step()`` waits for it, so it
goes before any waiting I/O thread (never before one already inside: sections are short, one shard at most).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from ..format.healthpass import usable_cpus

__all__ = ["CpuGate", "auto_limit"]


def auto_limit(on_gpu: bool = False) -> int:
    """The cores training leaves over: usable CPUs minus the training's threads, at least one."""
    training = 1 if on_gpu else torch.get_num_threads()
    return max(1, usable_cpus() - training)


class CpuGate:
    """A counting gate with priority for urgent callers; ``limit`` is read at every entry, so a later
    ``torch.set_num_threads`` is followed. ``limit=None``: no gate."""

    def __init__(self, limit: int | Callable[[], int] | None) -> None:
        self._cond = threading.Condition()
        self._limit: Callable[[], int] | None = None
        self.limit = limit
        self._busy = 0
        self._urgent = 0  # urgent callers waiting: the others let them in first
        self._mine = threading.local()  # whether this thread is inside: a nested section passes (no self-deadlock)
        self.waits = 0  # entries that had to wait (tests, stats)

    @property
    def limit(self) -> Callable[[], int] | None:
        return self._limit

    @limit.setter
    def limit(self, limit: int | Callable[[], int] | None) -> None:
        with self._cond:
            self._limit = (lambda: limit) if isinstance(limit, int) else limit
            self._cond.notify_all()  # a raised limit lets waiters in

    @contextmanager
    def held(self, urgent: bool = False) -> Iterator[None]:
        """Run the ``with`` body as one of at most ``limit`` CPU-bound sections."""
        if self._limit is None or getattr(self._mine, "held", False):  # unlimited, or already inside (nested)
            yield
            return
        with self._cond:
            if urgent:
                self._urgent += 1
            try:
                if self._blocked(urgent):
                    self.waits += 1
                    self._cond.notify_all()  # whoever waits for ``waits`` to change (tests) learns it at once
                    while self._blocked(urgent):
                        self._cond.wait()
            finally:
                if urgent:
                    self._urgent -= 1
            self._busy += 1
        self._mine.held = True
        try:
            yield
        finally:
            self._mine.held = False
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def wait_for_waits(self, n: int, timeout: float) -> bool:
        """Until ``n`` entries have had to wait (or ``timeout`` seconds): whether they had."""
        with self._cond:
            return self._cond.wait_for(lambda: self.waits >= n, timeout)

    def _blocked(self, urgent: bool) -> bool:
        assert self._limit is not None
        return self._busy >= max(1, self._limit()) or (not urgent and self._urgent > 0)
