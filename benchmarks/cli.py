"""The ``fastckpt`` command's start-up cost: ``cli_help_s``, the wall time of ``fastckpt --help``.

Issue 11 asked for an answer in well under a second (it took 3.4 s when the command imported torch
up front; the command now imports torch only inside the commands that need it). Each repeat is a
fresh interpreter started with ``subprocess`` and timed from outside, as a user waits for it:
``python -m benchmarks.cli`` prints the figure, ``python -m benchmarks.run`` records it (section ``cli``).
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
from typing import Any

from . import REPO, repo_env
from .labels import own_run_label


__all__ = ["measure", "markdown"]


def measure(reps: int = 7) -> dict[str, Any]:
    """Min and median seconds of ``python -m fastckpt --help`` over ``reps`` fresh interpreters."""
    env = repo_env()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fastckpt", "--help"], check=True, env=env, cwd=REPO,
                       stdout=subprocess.DEVNULL, timeout=120)
        times.append(time.perf_counter() - t0)
    return {"cli_help_s": min(times), "cli_help_median_s": statistics.median(times), "reps": reps}


def markdown(res: dict[str, Any] | None) -> list[str]:
    """The report's lines for the ``cli`` section (none when it was not measured)."""
    if not res:
        return []
    if not res.get("ok"):
        return ["## Command line", "", f"`fastckpt --help`: n/a ({res.get('error')})", ""]
    r = res["result"]
    return ["## Command line", ""] + own_run_label(res.get("meta")) + [
            f"`fastckpt --help` answers in **{r['cli_help_s'] * 1000:.0f} ms** (min of {r['reps']} fresh "
            f"interpreters; median {r['cli_help_median_s'] * 1000:.0f} ms), timed from outside with subprocess "
            "(`cli_help_s`): the command imports torch only inside the commands that need it.", ""]


if __name__ == "__main__":
    r = measure()
    print(f"cli_help_s {r['cli_help_s']:.3f}  (median {r['cli_help_median_s']:.3f} over {r['reps']} runs)")
