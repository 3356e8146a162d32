"""benchmarks/copyfloor.py: each kind of background pass runs beside the training step on the other CPU, reports its
rate, and the training time lost per GB of state comes out for every run; its scratch file is gone after."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import REPO, copyfloor, repo_env

needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                    reason="the training step and the background pass need a CPU each")


@needs_two_cpus
def test_every_kind_runs_and_reports_its_rate_and_the_loss(tmp_path: Path) -> None:
    """In a process of its own, as from the command line: the measure pins its process to one CPU, sets torch's
    threads to one and tunes malloc, which must not follow the rest of the test session."""
    out = tmp_path / "floor.json"
    kinds = ("one-pass", "crc32c", "disk-write")
    env = repo_env()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.copyfloor", "--kinds", ",".join(kinds), "--steps", "2",
                           "--reps", "1", "--shape", "quick", "--state-mb", "32", "--workdir", str(tmp_path / "w"),
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["state_bytes"] == 32 << 20 and list(res["runs"]) == list(kinds)
    for kind in kinds:
        (run,) = res["runs"][kind]
        assert run["gb_s"] > 0 and math.isfinite(run["lost_s_per_gb"]), (kind, run)
        assert 0 < run["opt_idle_s"] < run["idle_s"] and 0 < run["opt_busy_s"] < run["busy_s"], (kind, run)
    assert len(res["idle_s"]) == 2 * len(kinds)
    assert list((tmp_path / "w").iterdir()) == []  # the disk-write file went with its scratch directory
    table = proc.stdout.split("\n\n")[-1].splitlines()
    assert [line.split()[0] for line in table[1:]] == list(kinds)


@pytest.mark.parametrize("argv", [["--kinds", "copy_,nonesuch"], ["--steps", "0"], ["--state-mb", "20"],
                                  ["--shape", "huge"]])
def test_bad_arguments_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        copyfloor.main(argv)


def _fake(lost_ms: dict[str, list[float]]) -> dict:
    return {"train_state_bytes": 2_000_000_000, "state_bytes": 1 << 30,
            "runs": {k: [{"lost_s_per_gb": x / 1e3, "gb_s": 10.0, "idle_s": 0.3, "busy_s": 0.35} for x in v]
                     for k, v in lost_ms.items()}}


def test_from_pools_saved_measurements_and_writes_the_floor_section(tmp_path: Path) -> None:
    """--from pools several --json files (one measurement or a list each); --write puts the section into the report
    in place of the old one, the floor = (copy + disk) per GB x the state's GB."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_fake({"copy_": [10, 30], "disk-write": [20]})))
    b.write_text(json.dumps([_fake({"copy_": [20], "disk-write": [20, 20], "crc32c": [1]})]))
    report = tmp_path / "BENCHMARKS.md"
    report.write_text(f"# r\n\n## Plain\n\nx\n\n{copyfloor.HEADING}\n\nold figures\n\n## Methodology\n\nm\n")
    pooled = tmp_path / "pooled.json"
    assert copyfloor.main(["--from", str(a), str(b), "--write", str(report), "--json", str(pooled)]) == 0
    text = report.read_text()
    assert "old figures" not in text and text.count(copyfloor.HEADING) == 1
    assert text.index("## Plain") < text.index(copyfloor.HEADING) < text.index("## Methodology")
    assert "| `copy_` | 10.0 GB/s | 20.0 ms (10, 20, 30) | 40 ms | - |" in text  # saved without the split
    assert "Where in the step" not in text
    assert "20 + 20 ms per GB here: 80 ms per checkpoint of 2.00 GB" in text
    assert len(json.loads(pooled.read_text())) == 2


def test_the_floor_section_survives_a_full_runs_rewrite() -> None:
    from benchmarks import gpu_report

    assert copyfloor.HEADING in gpu_report.CARRIED


def _split(idle: float, busy: float, opt_idle: float, opt_busy: float) -> dict:
    return {"lost_s_per_gb": 0.02, "gb_s": 10.0, "idle_s": idle, "busy_s": busy, "opt_idle_s": opt_idle,
            "opt_busy_s": opt_busy}


def test_the_loss_is_split_between_the_optimizer_step_and_the_rest() -> None:
    """Pooled over the runs that timed the optimizer step; nothing said where the step barely slowed (noise)."""
    alike = [_split(0.30, 0.40, 0.15, 0.20), _split(0.30, 0.36, 0.15, 0.18), _split(0.30, 0.30, 0.15, 0.15)]
    lost_in, takes = copyfloor.optimizer_share(alike)
    assert lost_in == pytest.approx(0.5) and takes == pytest.approx(0.5)
    assert copyfloor.optimizer_share([_split(0.30, 0.31, 0.15, 0.16)]) is None  # 3% slower: within the noise
    assert copyfloor.optimizer_share([{"idle_s": 0.3, "busy_s": 0.4, "lost_s_per_gb": 0.02, "gb_s": 1}]) is None
    res = {"train_state_bytes": 1_000_000_000, "state_bytes": 1 << 30,
           "runs": {"copy_": alike, "disk-write": [_split(0.30, 0.40, 0.15, 0.20)]}}
    text = copyfloor.markdown([res], "cmd", "machine")
    assert "| `copy_` | 10.0 GB/s | 20.0 ms (20, 20, 20) | 20 ms | 50% (50%) |" in text
    assert "50% is lost inside the optimizer step" in text and "slow every part of the step alike" in text
    res["runs"]["copy_"] = [_split(0.30, 0.40, 0.10, 0.19)]  # 90% of the loss in a third of the step
    text = copyfloor.markdown([res], "cmd", "machine")
    assert "90% is lost inside the optimizer step (timed by its pre and post hooks), which takes 33%" in text
    assert "gathers in the optimizer step: pausing the background writes during it" in text
