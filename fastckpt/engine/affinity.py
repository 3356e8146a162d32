"""Which CPUs the background threads run on (``persist.background_cpus``): off the cores training uses.

The CPU gate (engine/cpugate.py) bounds how many background threads burn CPU at once, but not where: the scheduler
places a thread the training thread wakes (the copy thread at ``save()``, an I/O worker at a queued write) on the
training thread's own core when it can, and the two then share that core in turns while the other one idles. In the
plain loop on the 2-core benchmark host (1.48 GB every 6 steps of ~1.55 s, one training thread, 2026-11-29) the
training thread was preempted ~175-700 times in each step that saved, against ~3 in the others. Stall per checkpoint
(``python -m benchmarks.placement``: 3 runs of 9 checkpoints per setting, in turns): 52 +- 8 ms (mean, standard
error; median 43) with ``all`` against 11 +- 9 ms (median 16) with ``auto``; an earlier trial of the same, 66 +- 10
against 16 +- 11 ms. (Pinning the training thread too, which a library must not do, gave 27 +- 10 ms in a trial:
the background threads' placement is what counts.)

``auto``: where this process may use two CPUs or more, the background threads run on the last ``limit`` of them
(``limit``: the gate's count of cores training leaves over, at most all but one), so the first ones stay for the
training thread and the scheduler's placement of it; and at each ``save()`` never on the CPU the training thread is
running on right then (``sched_getcpu``): the scheduler moves the training thread between steps, and on the busy
host (two CPU-bound neighbours pinned to each of 2 CPUs) it was on the last CPU, sharing it with every background
thread, in ~40% of the steps (a lazy save resolves the set inside ``save()`` and its copy thread moves the threads:
the system calls stay off the training thread). Placed away from it at each save, the busy host's stall per
checkpoint (``python -m benchmarks.placement --busy --runs 8``, 96 checkpoints per setting in turns, 2026-11-30): 32 +- 3 ms (median 31)
against 37 +- 3 ms (median 34) held on the last CPU; two earlier trials of the same, 31.0 +- 3.6 against 37.7 +- 2.6
and 46.2 +- 3.3 against 52.4 +- 3.8 ms. A persister process's threads (fastckpt/tiers/persister.py) are placed once,
on the last CPUs: that process cannot see where the training thread runs. Not where torchrun started several ranks on
the node (``LOCAL_WORLD_SIZE`` > 1): every rank would put its threads on the same last cores, so there each rank's
threads are left to the scheduler (a list per rank places them). ``all``: no pinning. A list of CPU ids: exactly
those (a CPU the process may not use is a ``ConfigError`` naming the field and the usable ones). An OS without
per-thread affinity, or a kernel that refuses, leaves the threads where they are: placement is an optimisation, never
a reason to fail a checkpoint.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
from typing import Any, Callable, Collection

from ..errors import ConfigError
from .once import WARNED
from ..format.healthpass import usable_cpu_ids as usable  # the CPUs this process may run on, ascending

__all__ = ["CHOICES", "ThreadPlacement", "current_cpu", "offered_cpus", "resolve", "usable"]

log = logging.getLogger("fastckpt")

CHOICES = ("auto", "all")  # or a list of CPU ids


def resolve(setting: str | Collection[int], limit: int, cpus: list[int] | None = None,
            avoid: int | None = None) -> frozenset[int] | None:
    """The CPUs the background threads run on for ``setting`` (None: wherever the scheduler puts them), given
    ``limit`` cores left over by training, the usable ``cpus`` (default: this process's) and, for ``auto``, the CPU
    the training thread runs on now (``avoid``; None: unknown)."""
    cpus = usable() if cpus is None else cpus
    if setting == "all" or not cpus:
        return None
    if setting == "auto":
        if len(cpus) < 2 or _local_ranks() > 1:
            if len(cpus) == 1:
                _say_one_cpu(cpus[0])
            return None
        count = max(1, min(limit, len(cpus) - 1))
        return frozenset([c for c in cpus if c != avoid][-count:])
    chosen = frozenset(setting)  # type: ignore[arg-type]
    if not chosen <= set(cpus):
        raise ConfigError(f"persist.background_cpus lists CPUs {sorted(chosen - set(cpus))} this process may not "
                          f"use (it may use {cpus}); list some of those, or set it to auto or all")
    return chosen


def _say_one_cpu(cpu: int) -> None:
    """Once per process: the calling thread may use CPU ``cpu`` alone where this machine (its CPU cgroup) offers
    more. The threads fastckpt makes start from their maker's CPU mask, so a training thread pinned to one CPU before
    the ``Checkpointer`` is built gives them that CPU too, and every byte they copy, check and write then runs in
    turns with training (the launch-bound benchmark did that until 2026-12-07: its training thread waited ~480 ms
    a checkpoint for its CPU). ``taskset -c`` on the whole process is the same case, chosen: then it says so once."""
    if not WARNED.first("one-cpu"):  # asked first: resolve() runs at every save, the cgroup is read once
        return
    offered = offered_cpus()
    if len(offered) > 1:
        log.warning("fastckpt: this thread may run on CPU %d alone, so the background threads share it with training "
                    "(checkpoints then slow training down); this machine offers CPUs %s: pin the training thread "
                    "after building the Checkpointer, or give the process more than one CPU", cpu, _ranges(offered))


def offered_cpus() -> list[int]:
    """The CPUs of this process's CPU cgroup (cgroup v2 ``cpuset.cpus.effective``, v1 ``cpuset.effective_cpus``),
    else every online CPU: what a thread may be given, whatever its maker's mask."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            with open(path) as f:
                cpus = _parse(f.read())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return list(range(os.cpu_count() or 1))


def _parse(text: str) -> list[int]:
    """``0-3,6`` -> [0, 1, 2, 3, 6]."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


def _ranges(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> ``0-2,5``."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _local_ranks() -> int:
    """How many ranks torchrun started on this node (``LOCAL_WORLD_SIZE``; 1 outside it)."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return 1


class ThreadPlacement:
    """The background threads of one pipeline and the CPUs they run on. ``enlist`` runs on each thread as it
    starts; ``place`` (any thread) moves every enlisted live thread at once when the set changes."""

    def __init__(self, apply: Callable[[int, frozenset[int]], None] | None = None,
                 where: Callable[[], int | None] | None = None) -> None:
        self._apply = apply or _set_affinity
        self._where = where or current_cpu  # the CPU the calling thread runs on now (None: unknown)
        self._lock = threading.Lock()
        self._threads: dict[int, threading.Thread] = {}  # native id -> thread (dead ones are dropped on place)
        self._cpus: frozenset[int] | None = None
        self._everywhere = frozenset(usable())  # where an unpinned thread may run: the process's own CPUs
        self._setting: str | Collection[int] = "all"
        self._limit: Callable[[], int] = lambda: 1

    @property
    def cpus(self) -> frozenset[int] | None:
        return self._cpus

    def follow(self, setting: str | Collection[int], limit: Callable[[], int]) -> None:
        """``persist.background_cpus``, with the gate's count of cores training leaves over (read again at every
        ``refresh``: a state that moves to a GPU leaves more); a list naming CPUs this process may not use raises
        ``ConfigError`` here, when the ``Checkpointer`` is built."""
        self._setting, self._limit = setting, limit
        self.refresh()

    def want(self) -> frozenset[int] | None:
        """The CPUs the setting gives as things stand, away from the calling thread's CPU under ``auto``: what
        ``refresh`` places. The usable CPUs are the mask of the thread that built the placement (the threads start
        from it), not the caller's now: a training thread that pins itself to its CPU after building the
        ``Checkpointer`` still has its background placed on the others."""
        return resolve(self._setting, self._limit(), cpus=sorted(self._everywhere) or None,
                       avoid=self._where() if self._setting == "auto" else None)

    def refresh(self) -> None:
        """Place the threads for the setting as things stand (``want``), away from the calling thread's CPU under
        ``auto``. A lazy save resolves the set inside ``save()`` and leaves moving the threads (system calls, ~0.1
        ms of save() whenever the scheduler had moved training) to the copy thread (engine/pipeline.py)."""
        self.place(self.want())

    def with_(self, *first: Callable[[], Any]) -> Callable[[], None]:
        """A thread pool's initializer: each of ``first``, then ``enlist()``."""
        return lambda: ([f() for f in first], self.enlist())[-1]

    def enlist(self, thread: threading.Thread | None = None) -> None:
        """Record ``thread`` (default: the calling one) and place it on the current set."""
        thread = thread or threading.current_thread()
        tid = thread.native_id
        if tid is None:  # not started yet: nothing to place
            return
        with self._lock:  # applied under the lock, as ``place`` does: never a set older than the recorded one
            self._threads[tid] = thread
            if self._cpus is not None:
                self._apply(tid, self._cpus)

    def place(self, cpus: frozenset[int] | None) -> None:
        """Run every enlisted thread on ``cpus`` from now on (None: back on all of the process's CPUs)."""
        with self._lock:  # held while applying: two threads placing at once (the copy thread, an eager save's
            if cpus == self._cpus:  # training thread) leave every thread on the set recorded last
                return
            self._cpus = cpus
            self._threads = {tid: t for tid, t in self._threads.items() if t.is_alive()}
            target = cpus if cpus is not None else self._everywhere
            if target:
                for tid in self._threads:
                    self._apply(tid, target)


@functools.cache
def _sched_getcpu() -> Callable[[], int] | None:
    """libc's ``sched_getcpu`` (a vDSO read on Linux, well under a microsecond); None where there is none."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn


def current_cpu() -> int | None:
    """The CPU the calling thread is running on now; None where the OS cannot say."""
    fn = _sched_getcpu()
    if fn is None:
        return None
    cpu = fn()
    return cpu if cpu >= 0 else None


_refused = False


def _set_affinity(tid: int, cpus: frozenset[int]) -> None:
    global _refused
    try:
        os.sched_setaffinity(tid, cpus)
    except (AttributeError, OSError) as e:  # a thread that just ended, a kernel that refuses, no such call
        if not _refused and not isinstance(e, ProcessLookupError):
            _refused = True
            log.info("fastckpt: background threads left on every CPU (could not set their affinity: %s)", e)
