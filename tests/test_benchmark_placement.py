"""benchmarks/placement.py's report: each setting's mean, standard error and median over every checkpoint of its
runs, and a section that a full report's re-render keeps."""
from __future__ import annotations

import os
import re
import statistics

from benchmarks import gpu_report, placement


def _runs() -> list[dict]:
    return [{"setting": "all", "stalls_s": [0.06, 0.08, 0.10], "step_s": 1.5, "threads": [("fastckpt-copy", (0, 1))]},
            {"setting": "auto", "stalls_s": [0.01, -0.02, 0.03], "step_s": 1.6, "threads": [("fastckpt-copy", (1,))]},
            {"setting": "all", "stalls_s": [0.05, 0.07, 0.09], "step_s": 1.5, "threads": [("fastckpt-copy", (0, 1))]},
            {"setting": "auto", "stalls_s": [0.02, 0.00, 0.04], "step_s": 1.5, "threads": [("fastckpt-copy", (1,))]}]


def test_every_checkpoint_of_every_run_counts_once_per_setting() -> None:
    got = placement.summary(_runs())
    xs = [0.06, 0.08, 0.10, 0.05, 0.07, 0.09]
    assert got["all"]["n"] == 6 and abs(got["all"]["mean_s"] - statistics.mean(xs)) < 1e-12
    assert abs(got["all"]["se_s"] - statistics.stdev(xs) / 6 ** 0.5) < 1e-12
    assert abs(got["auto"]["median_s"] - 0.015) < 1e-12


def test_the_section_names_the_settings_their_figures_and_where_the_threads_ran() -> None:
    md = placement.markdown(_runs(), "python -m benchmarks.placement --runs 2", "test machine")
    assert md.startswith(placement.HEADING)
    assert "| `all` | 6 | 75 +- 8 ms | 75 ms | fastckpt-copy: [0, 1] |" in md
    assert "| `auto` | 6 | 13 +- 9 ms | 15 ms | fastckpt-copy: [1] |" in md
    assert placement.HEADING in gpu_report.CARRIED  # a full run's re-render keeps it


def _busy_runs() -> list[dict]:
    return [{"setting": "last", "stalls_s": [0.03, 0.04, 0.05], "step_s": 0.06, "threads": [("background_cpus", (1,))]},
            {"setting": "auto", "stalls_s": [0.01, 0.02, 0.03], "step_s": 0.06, "threads": [("background_cpus",
                                                                                             ("auto",))]},
            {"setting": "auto", "stalls_s": [0.05, 0.04, 0.06], "step_s": 0.07, "threads": [("background_cpus",
                                                                                             ("auto",))]},
            {"setting": "last", "stalls_s": [0.04, 0.03, 0.04], "step_s": 0.06, "threads": [("background_cpus", (1,))]}]


def test_the_busy_section_shows_each_runs_own_median_beside_the_pooled_figures() -> None:
    got = placement.summary(_busy_runs(), placement.BUSY_SETTINGS)
    assert got["auto"]["run_medians_s"] == [0.02, 0.05] and got["last"]["run_medians_s"] == [0.04, 0.04]
    md = placement.busy_markdown(_busy_runs(), "python -m benchmarks.placement --busy --runs 2", "test machine")
    assert md.startswith(placement.BUSY_HEADING + "\n")
    assert "| `auto` | 6 | 35 +- 8 ms | 35 ms | 20, 50 ms |" in md
    assert "| `last` | 6 | 38 +- 3 ms | 40 ms | 40, 40 ms |" in md
    assert placement.BUSY_HEADING in gpu_report.CARRIED
    # the two sections are told apart by their whole heading: merging one leaves the other
    both = gpu_report.merge(gpu_report.merge("# r\n\n## Methodology\n", "## Background thread placement\n\nA\n",
                                             placement.HEADING), md, placement.BUSY_HEADING)
    assert gpu_report.existing(both, placement.HEADING) == "## Background thread placement\n\nA\n\n"
    assert gpu_report.existing(both, placement.BUSY_HEADING).startswith(placement.BUSY_HEADING)


def test_the_machine_line_of_a_section_now_or_as_a_run_recorded_it() -> None:
    """Hand-run sections (placement, copyfloor) take the machine as it is now; a full run's own section passes what
    it recorded at its start, in the same words."""
    from benchmarks.report import machine_line

    assert machine_line("AMD EPYC", 2, 1.3, "2026-11-30 19:31:35") == (
        "AMD EPYC, 2 CPUs, load average at the end 1.3, 2026-11-30 19:31:35")
    now = machine_line()
    assert f", {len(os.sched_getaffinity(0))} CPUs, load average at the end " in now
    assert re.search(r", \d{4}-\d\d-\d\d \d\d:\d\d$", now), now
