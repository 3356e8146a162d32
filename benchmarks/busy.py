"""The busy-host scenario: the plain loop while CPU-bound neighbour processes keep every core busy.

DataLoader workers decoding images or tokenizing text keep a training host's cores saturated. Then a
background thread at lowered priority (fastckpt's ``persist.priority: idle|low``) gets almost no CPU, and
checkpoints may pile up, and the training thread waits whenever such a thread was preempted holding the GIL. This task runs ``measure.task_core`` for one peer with ``neighbours`` pure-Python
spin loops beside it (default: one more than the host has cores), each started before the peer and stopped
after it, and adds back-to-back ``save()`` + ``flush()`` pairs: the time to a durable commit.

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
    "import sys, time\n"
    "deadline = time.monotonic() + float(sys.argv[1])\n"
    "sys.stdout.write('spinning\\n'); sys.stdout.flush()\n"
    "while time.monotonic() < deadline:\n"
    "    sum(range(1000))\n"
)


def default_neighbours() -> int:
    """One more CPU-bound neighbour than the host has cores: every core stays busy."""
    return (os.cpu_count() or 1) + 1


@contextlib.contextmanager
def neighbours(n: int, limit_s: float) -> Iterator[list[int]]:
    """``n`` spinning processes for the duration of the block (each spinning before the block starts)."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPIN, str(limit_s)], stdout=subprocess.PIPE,
                                          text=True))
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
              durable_reps: int, n_neighbours: int | None, limit_s: float) -> dict[str, Any]:
    """``task_core`` for ``peer`` with CPU-bound neighbours, plus ``durable_reps`` timed save + flush pairs.
    ``n_neighbours`` 0: the same run on the quiet host (the reference of the busy stall)."""
    n = default_neighbours() if n_neighbours is None else n_neighbours
    with neighbours(n, limit_s):
        out = task_core(peer, shape, root, warmup, every, n_ckpt, base_steps, durable_reps=durable_reps)
    out["neighbours"] = n
    return out
