"""The busy-host scenario: the plain loop while CPU-bound neighbour processes keep every core busy.

DataLoader workers decoding images or tokenizing text keep a training host's cores saturated. Then a
background thread at lowered priority (fastckpt's ``persist.priority: idle|low``) gets almost no CPU, and
checkpoints may pile up, and the training thread waits whenever such a thread was preempted holding the GIL. This
task runs ``measure.task_core`` for one peer with ``neighbours`` pure-Python spin loops beside it (default: two per
CPU this process may use, each pinned to its CPU), each started before the peer and stopped after it, and adds
back-to-back ``save()`` + ``flush()`` pairs: the time to a durable commit.

Why pinned, two a CPU: with one more free-running spin loop than cores (3 on 2 CPUs, the scenario until 2026-11-29)
the load balancer now and then left the training thread a CPU of its own for a few windows (its steps 30 ms instead
of 75 ms), so one run's paired stall depended on which windows those spells hit: fastckpt's busy stall came out
+76 to +116 ms in some runs and -35 to -50 ms in others, the same code, minutes apart (BENCHMARKS.md, "Where the
stall goes"). With every CPU holding the same two pinned loops, the training thread shares a CPU with two of them
wherever it runs: three runs gave 36, 38 and 40 ms. Every peer runs beside the same neighbours.

Each neighbour is bounded: it stops by itself after ``limit_s`` even if this process dies without killing it.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Any, Iterator

from .measure import task_core

_SPIN = (
    "import os, sys, time\n"
    "if len(sys.argv) > 2: os.sched_setaffinity(0, {int(sys.argv[2])})\n"  # before it says it spins
    "deadline = time.monotonic() + float(sys.argv[1])\n"
    "sys.stdout.write('spinning\\n'); sys.stdout.flush()\n"
    "while time.monotonic() < deadline:\n"
    "    sum(range(1000))\n"
)


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def default_neighbours() -> int:
    """Two CPU-bound neighbours per CPU this process may use: every core stays busy, each alike."""
    return 2 * len(_cpus())


@contextlib.contextmanager
def neighbours(n: int, limit_s: float, pin: bool = True) -> Iterator[list[int]]:
    """``n`` spinning processes for the duration of the block (each spinning before the block starts); ``pin``:
    the i-th on the i-th CPU this process may use, round robin."""
    procs: list[subprocess.Popen] = []
    cpus = _cpus()
    try:
        for i in range(n):
            where = [str(cpus[i % len(cpus)])] if pin else []
            procs.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(limit_s), *where],
                                          stdout=subprocess.PIPE, text=True))
        for p in procs:
            if p.stdout is None or p.stdout.readline() != "spinning\n":  # a pipe, not a sleep: it runs now
                raise RuntimeError(f"neighbour process {p.pid} did not start")
        yield [p.pid for p in procs]
    finally:
        for p in procs:  # only the processes started here, by their own handle
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


def task_busy(peer: str, shape: dict, root: str, warmup: int, every: int, n_ckpt: int, base_steps: int,
              durable_reps: int, n_neighbours: int | None, limit_s: float, pin: bool = True) -> dict[str, Any]:
    """``task_core`` for ``peer`` with CPU-bound neighbours, plus ``durable_reps`` timed save + flush pairs.
    ``n_neighbours`` 0: the same run on the quiet host (the reference of the busy stall)."""
    n = default_neighbours() if n_neighbours is None else n_neighbours
    with neighbours(n, limit_s, pin):
        out = task_core(peer, shape, root, warmup, every, n_ckpt, base_steps, durable_reps=durable_reps)
    out["neighbours"], out["pinned"] = n, pin
    return out
