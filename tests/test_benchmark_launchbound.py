"""Issue 53: the launch-bound benchmark and the GIL hand-over count run end to end (tiny model, seconds).

``benchmarks.launchbound`` measures every peer in a process of its own and writes the time lost, the CPU-seconds and
the save() times; ``benchmarks.gilcalls`` counts each thread's GIL hand-overs with its LD_PRELOAD shim (it needs
a C compiler: where none is installed it says so and exits 2, and this test checks that message instead).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

from benchmarks import REPO, repo_env


def test_launchbound_quick_run_measures_each_peer(tmp_path) -> None:
    out = tmp_path / "lb.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.launchbound", "--quick", "--window", "0.2", "--n-ckpt", "1",
                          "--n-cpu", "1", "--peers", "fastckpt,torch_save", "--json", str(out)],
                         cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(out.read_text())
    for peer in ("fastckpt", "torch_save"):
        s = doc["summary"][peer]
        assert "error" not in s, s
        assert s["median"]["cpu_s"] > 0 and s["median"]["save_ms"] > 0 and len(s["lost_ms"]) == 1
    assert "## The launch-bound training thread" in run.stdout


def test_gilcalls_counts_the_background_hand_overs(tmp_path) -> None:
    out = tmp_path / "gil.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.gilcalls", "--quick", "--checkpoints", "1", "--json",
                          str(out)], cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=600)
    if not (shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")):
        assert run.returncode == 2 and "no C compiler" in run.stderr
        return
    assert run.returncode == 0, run.stderr[-2000:]
    row = json.loads(out.read_text())["per_checkpoint"][0]
    assert row.get("fastckpt-copy", 0) > 0 and row["save() (training thread)"] > 0, row


def test_the_launching_thread_is_pinned_only_while_it_launches() -> None:
    """Peers' threads are made by the training thread (in their constructor or ``save()``): pinned for the whole
    run, it gave them its one CPU, and every peer's background then competed with it for that CPU."""
    import os
    import threading
    import time

    import pytest

    from benchmarks.launchbound import Launcher

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to tell a pinned thread from a free one")
    seen: dict[str, set[int]] = {}
    launcher = Launcher(cpus[0])
    n = launcher.run_until(time.perf_counter() + 0.05)
    assert n > 0 and launcher.count > 0 and launcher.median() > 0
    assert os.sched_getaffinity(0) == set(cpus)  # restored after the launches
    t = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getaffinity(0)))
    t.start()
    t.join()
    assert seen["child"] == set(cpus)
    # a stalled iteration counts its excess over the median; ordinary ones do not
    launcher.times[:4] = [1e-5, 1e-5, 1e-5, 1e-3]
    launcher.count = 4
    assert abs(launcher.stalled(1e-5) - (1e-3 - 1e-5)) < 1e-12
