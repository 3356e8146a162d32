"""The multi-rank script harness keeps every rank's output and shows it when a phase fails."""
from __future__ import annotations

import os
import select
import sys
from pathlib import Path

from tests.rank_logs import run_phase

HERE = Path(__file__).resolve().parent

SCRIPT = """
import os, subprocess, sys
from rank_logs import split_rank_output
split_rank_output()
rank = os.environ.get("LOCAL_RANK", "0")
print(f"out of rank {rank}", flush=True)
print(f"err of rank {rank}", file=sys.stderr, flush=True)
if rank == "0":  # as Lightning's launcher does: the other ranks re-run the script with the parent's stdout/stderr
    for r in (1, 2):
        subprocess.run([sys.executable, __file__], env=dict(os.environ, LOCAL_RANK=str(r)), check=True)
    sys.exit(3)  # the phase fails: its report must show every rank
"""


def test_every_ranks_output_is_kept_apart_and_reported(tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    code, err, report = run_phase([sys.executable, str(script)], env, tmp_path / "logs", 60)
    assert code == 3
    assert (tmp_path / "logs" / "rank1.log").read_text() == "out of rank 1\nerr of rank 1\n"
    for r in (0, 1, 2):
        assert f"err of rank {r}" in err and f"out of rank {r}" in report and f"err of rank {r}" in report


def _rank_one_fails(rank: int, world: int) -> None:
    print(f"rank {rank} was here", flush=True)
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")


def test_a_failing_spawned_rank_reports_every_ranks_output() -> None:
    """run_ranks (torch.multiprocessing) reported only the failing rank's traceback: the others' lines went, mixed,
    to the shared stdout and a rank killed after the failure left none. The failure must carry every rank's output."""
    import pytest

    from tests.dist_launcher import RanksFailed, run_ranks

    with pytest.raises(RanksFailed) as info:
        run_ranks(_rank_one_fails, 2)
    message = str(info.value)
    assert "----- rank0 -----\nrank 0 was here" in message
    assert "----- rank1 -----\nrank 1 was here" in message and "ValueError: rank 1 fails on purpose" in message


def _ranks_hang(rank: int, world: int, folder: str) -> None:
    import threading

    import torch.distributed as dist
    print(f"rank {rank} was here", flush=True)
    Path(folder, f"hangs{rank}").touch()  # the last thing before the blocking call: the test's clock waits for it
    if rank == 0:
        dist.barrier()  # waits for rank 1, which never comes: gloo's own timeout is 30 minutes
    else:
        threading.Event().wait()


class _ClockPastTheDeadlineOnceHung:
    """``dist_launcher``'s clock: the real one until every rank is in its blocking call, then ``DEADLINE_S`` later.

    A real deadline had to cover the spawned ranks' start (torch's import, gloo's rendezvous: seconds, many more on a
    loaded host) and so made the test wait 40 s. This clock makes the deadline's path run once the ranks do hang,
    however long their start took. "In its blocking call": a rank's file (written just before the call) was seen at a
    read of this clock at least a second earlier; the launcher reads it around each of its polls (``join`` for up to
    5 s), so in practice a whole poll passes between the files and the dump."""

    def __init__(self, folder: Path, world: int, jump: float) -> None:
        self._files = [folder / f"hangs{r}" for r in range(world)]
        self._jump = jump
        self._seen: float | None = None

    def monotonic(self) -> float:
        import time

        now = time.monotonic()
        if self._seen is None and all(f.exists() for f in self._files):
            self._seen = now
        return now + self._jump if self._seen is not None and now - self._seen >= 1.0 else now


def test_hung_ranks_are_dumped_and_killed_before_pytest_timeout(monkeypatch, tmp_path) -> None:
    """A hung rank was cut by pytest-timeout in the parent, whose report showed the parent's frame only: the
    launcher's deadline asks every rank for its threads, kills them and raises with the stacks."""
    import pytest

    from tests import dist_launcher

    monkeypatch.setattr(dist_launcher, "DEADLINE_S", 40.0)
    monkeypatch.setattr(dist_launcher, "time", _ClockPastTheDeadlineOnceHung(tmp_path, 2, 40.0))
    with pytest.raises(dist_launcher.RanksFailed) as info:
        dist_launcher.run_ranks(_ranks_hang, 2, str(tmp_path))
    message = str(info.value)
    assert "ranks still running after 40 s" in message
    rank0, rank1 = message.split("----- rank0 -----")[1].split("----- rank1 -----")
    assert "rank 0 was here" in rank0 and "in _ranks_hang" in rank0 and "in barrier" in rank0
    assert "rank 1 was here" in rank1 and "in _ranks_hang" in rank1 and "in wait" in rank1


def _rank_leaves_work_for_its_exit(rank: int, world: int, folder: str) -> None:
    import atexit
    import threading

    gate = threading.Event()

    def late() -> None:  # a non-daemon thread with work left when the function returns
        gate.wait()
        total = 0
        for i in range(3_000_000):  # bytecode, not one C call: the GIL passes to the exiting main thread meanwhile
            total += i  # ~0.2 s: an exit that did not join this thread would cut it short
        Path(folder, f"thread{rank}").write_text(str(total))

    threading.Thread(target=late, name="late-writer").start()
    atexit.register(lambda: Path(folder, f"hook{rank}").write_text("ran"))
    print(f"rank {rank} returns", flush=True)
    gate.set()


def test_a_rank_that_returned_ends_as_the_interpreter_would_but_without_finalizing(tmp_path) -> None:
    """A rank that succeeded used to die at exit now and then (SIGABRT, "terminate called without an active
    exception": a gloo worker of torch's default group, which FSDP keeps alive past destroy_process_group, needed
    the GIL while the interpreter finalized). The launcher now ends a successful rank with ``os._exit(0)``, after
    what the interpreter's exit would have done: its exit hooks run and its non-daemon threads finish."""
    from tests.dist_launcher import run_ranks

    run_ranks(_rank_leaves_work_for_its_exit, 2, str(tmp_path))
    for rank in (0, 1):
        assert (tmp_path / f"hook{rank}").read_text() == "ran"
        assert (tmp_path / f"thread{rank}").read_text() == str(sum(range(3_000_000)))

HANGING = """
import os, signal, subprocess, sys
folder = sys.argv[1]
if len(sys.argv) > 2:  # the other rank: started by rank 0, as Lightning's launcher does, then stuck
    open(os.path.join(folder, "child.pid"), "w").write(str(os.getpid()))
    os.write(int(sys.argv[2]), b"up")
    signal.pause()
up, tell = os.pipe()
child = subprocess.Popen([sys.executable, __file__, folder, str(tell)], pass_fds=(tell,))
os.close(tell)
os.read(up, 2)  # the other rank is up (or gone: end of file)
print("both ranks up", file=sys.stderr, flush=True)
signal.pause()  # rank 0 stuck as well: the phase times out
"""


def test_a_timed_out_phase_takes_every_rank_with_it(tmp_path) -> None:
    """A phase cut short killed rank 0 only; the rank it started (Lightning's launcher's way) ran on as an orphan."""
    script = tmp_path / "hang.py"
    script.write_text(HANGING)
    # 5 s: two bare interpreters' start (a few tenths of a second on a loaded host), then the phase hangs
    code, err, _ = run_phase([sys.executable, str(script), str(tmp_path)], dict(os.environ), tmp_path / "logs", 5)
    assert code == -1 and "both ranks up" in err, err
    pid = int((tmp_path / "child.pid").read_text())
    # SIGKILLed, rank 1 closes its files (the pipes run_phase read to their end) before it becomes a zombie: on a
    # loaded machine it can still show state R here for a moment. Its pidfd turns readable once it has exited.
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone and reaped
    try:
        exited = bool(select.select([fd], [], [], 30)[0])
    finally:
        os.close(fd)
    if not exited:  # still running: end it here, then fail
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        os.kill(pid, 9)
        raise AssertionError(f"rank 1 (pid {pid}) outlived the timed-out phase by 30 s (state {state})")
