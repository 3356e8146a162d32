"""Scripts whose other ranks Lightning's launcher starts: every rank's output kept apart, and shown on failure.

Lightning's launcher re-runs the script for ranks 1..N-1 with the parent's stdout and stderr, so their lines mix
into rank 0's capture and a long rank-0 traceback pushes them out of the tail a failure message shows: a rank that
went away left no trace. ``split_rank_output`` (called first by the script) sends each other rank's output to its
own file; ``run_phase`` (called by the test) returns rank 0's output followed by every rank's file, whole on
failure.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

LOGS = "FASTCKPT_TEST_RANK_LOGS"  # set by run_phase for the script: the folder of the rank logs (tests only)


def split_rank_output() -> None:
    """Called first in a launched script: a rank other than 0 (``LOCAL_RANK`` set by the launcher) writes its
    stdout and stderr to ``rank<N>.log`` in the folder ``run_phase`` named."""
    folder, rank = os.environ.get(LOGS), os.environ.get("LOCAL_RANK", "0")
    if not folder or rank == "0":
        return
    fd = os.open(os.path.join(folder, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run_phase(args: list[str], env: dict[str, str], logs: Path, timeout: float) -> tuple[int, str, str]:
    """Run the script; return its exit code, rank 0's stderr followed by every other rank's log (what a test greps),
    and a report of everything every rank printed (for a failure message)."""
    logs.mkdir(parents=True, exist_ok=True)
    # Its own session: a phase cut short (this timeout, or pytest-timeout's exception raised in here) must take the
    # other ranks with it. Lightning's launcher starts them as children of rank 0; killing rank 0 alone orphaned them
    # running until their next collective failed, burning CPU that the next test's ranks needed.
    proc = subprocess.Popen(args, env=dict(env, **{LOGS: str(logs)}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        code, err = -1, (err or "") + f"\n(timed out after {timeout} s)"
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise
    ranks = sorted(logs.glob("rank*.log"))
    others = "".join(f"\n----- {p.stem} -----\n{p.read_text(errors='replace')}" for p in ranks)
    report = (f"exit code {code}\n----- rank0 stdout -----\n{out[-4000:]}\n----- rank0 stderr -----\n{err[-8000:]}"
              + "".join(f"\n----- {p.stem} -----\n{p.read_text(errors='replace')[-8000:]}" for p in ranks))
    return code, err + others, report


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill rank 0's session (every rank), while rank 0 is not yet reaped: its pid is still the group's id."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # every rank already gone
        pass
