"""benchmarks/busy.py: the busy host's neighbours are pinned two to a CPU (one regime wherever the training thread
runs), spin before the task starts, and are gone after it."""
from __future__ import annotations

import os

import psutil

from benchmarks.busy import default_neighbours, neighbours


def test_neighbours_are_pinned_round_robin_and_gone_after_the_block() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    assert default_neighbours() == 2 * len(cpus)
    n = len(cpus) + 1  # one CPU gets two: round robin, not all on the first
    with neighbours(n, 60.0) as pids:
        assert [os.sched_getaffinity(p) for p in pids] == [{cpus[i % len(cpus)]} for i in range(n)]
        assert all(psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_unpinned_neighbours_may_run_anywhere() -> None:
    with neighbours(1, 60.0, pin=False) as pids:
        assert os.sched_getaffinity(pids[0]) == os.sched_getaffinity(0)
