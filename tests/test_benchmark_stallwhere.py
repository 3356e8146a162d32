"""benchmarks/stallwhere.py: the stall split by time and by thread is computed from what really happened."""
from __future__ import annotations

import threading

import numpy as np

from benchmarks.launchbound import Launcher
from benchmarks.stallwhere import ThreadCounters, _Excess, _family, attribute, markdown


def test_excess_counts_only_slow_iterations_ending_inside_the_interval() -> None:
    launcher = Launcher()
    times = [1e-3] * 10 + [10e-3] + [1e-3] * 5 + [20e-3] + [1e-3] * 3  # two stalls: 9 ms and 19 ms over the median
    launcher.times[:len(times)] = times
    launcher.count = len(times)
    ends = 5.0 + np.cumsum(times)
    first, second = ends[10], ends[16]
    excess = _Excess(launcher, 1e-3, 5.0)
    assert abs(excess.between(5.0, first + 1e-9) - 9e-3) < 1e-9
    assert abs(excess.between(first + 1e-9, 99.0) - 19e-3) < 1e-9
    assert abs(excess.between(5.0, 99.0) - launcher.stalled(1e-3)) < 1e-9
    assert excess.between(second + 1e-9, 99.0) == 0.0


def test_thread_cpu_is_booked_under_the_python_name_of_the_thread() -> None:
    done = threading.Event()

    def spin() -> None:
        x = 0
        while not done.is_set():
            x += 1

    counters = ThreadCounters(threading.get_native_id())
    before = counters.cpu_by_name()
    t = threading.Thread(target=spin, name="burner-7")
    t.start()
    try:
        while counters.cpu_by_name().get("burner", 0.0) < 0.05:  # its ticks show up under its pool's name
            pass
    finally:
        done.set()
        t.join()
    assert "burner" not in before and "training thread" in before
    assert _family("fastckpt-io_3") == "fastckpt-io" and _family("copy") == "copy"
    mine = counters.mine()
    assert mine["run_delay_s"] >= 0 and mine["sleeps"] >= 0 and mine["preempted"] >= 0


def test_a_quick_run_splits_fastckpt_stall_by_phase_and_thread() -> None:
    import os

    import torch

    threads, mask = torch.get_num_threads(), os.sched_getaffinity(0)
    res = attribute("fastckpt", 2, 0.5, quick=True)
    # the run's one intra-op thread and CPU mask stay the run's: a later test in this worker finds its own
    assert (torch.get_num_threads(), os.sched_getaffinity(0)) == (threads, mask)
    assert len(res["windows"]) == 2
    for w in res["windows"]:
        assert 0 < w["staged_at_s"] <= w["durable_at_s"], w
        assert any(k.startswith("bin") for k in w) and "run_delay_s" in w and "flush_s" in w
        assert "cpu:fastckpt-copy" in w, sorted(w)  # the copy thread ran in the window, under its own name
    text = markdown(res)
    assert "stalled" in text and "CPU-s of the checkpoint by thread" in text
