"""benchmarks/busy.py: the busy host's neighbours are pinned two to a CPU (one regime wherever the training thread
runs), spin before the task starts, and are gone after it; benchmarks/persister.py runs variants in turns there."""
from __future__ import annotations

import json
import os

import psutil
import pytest

from benchmarks import persister
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


def test_variants_ab_runs_the_two_pass_variant_beside_neighbours_and_quiet(tmp_path, capsys) -> None:
    """benchmarks/persister.py's A/B in turns: the busy task for a named variant, then its quiet twin; each run's
    restore bit-exact, and the summary has a busy and a quiet row per peer."""
    runs = tmp_path / "runs.json"
    assert persister.main(["--peers", "fastckpt-2pass,fastckpt", "--reps", "1", "--shapes", "tiny", "--every", "2",
                           "--n-ckpt", "1", "--neighbours", "1", "--quiet-too", "--json", str(runs)]) == 0
    got = json.loads(runs.read_text())
    assert [(r["peer"], r["busy"]) for r in got] == [("fastckpt-2pass", True), ("fastckpt-2pass", False),
                                                    ("fastckpt", True), ("fastckpt", False)]
    assert all(r["bit_exact"] is True for r in got)
    table = capsys.readouterr().out.split("\n\n")[-1]
    assert sum(" busy " in line for line in table.splitlines()) == 2
    assert sum(" quiet " in line for line in table.splitlines()) == 2


def test_variants_ab_refuses_an_unknown_peer_and_a_quiet_twin_without_neighbours() -> None:
    with pytest.raises(SystemExit):
        persister.main(["--peers", "fastckpt,nonesuch"])
    with pytest.raises(SystemExit):
        persister.main(["--quiet-too"])
