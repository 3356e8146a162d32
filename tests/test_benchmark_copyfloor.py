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

from benchmarks import copyfloor, repo_env

REPO = Path(__file__).resolve().parent.parent

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
    assert "| `copy_` | 10.0 GB/s | 20.0 ms (10, 20, 30) | 40 ms |" in text
    assert "20 + 20 ms per GB here: 80 ms per checkpoint of 2.00 GB" in text
    assert len(json.loads(pooled.read_text())) == 2


def test_the_floor_section_survives_a_full_runs_rewrite() -> None:
    from benchmarks import gpu_report

    assert copyfloor.HEADING in gpu_report.CARRIED
