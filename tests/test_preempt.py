"""Flush on preemption (fastckpt/engine/preempt.py): a signal takes a final checkpoint at the next safe point,
flushes it within grace_s, then goes on to the handler installed before; the trials of tests/preempt_trials.py."""
from __future__ import annotations

import random
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.errors import ConfigError
from tests import preempt_trials
from tests.helpers import assert_bit_equal, clone_state


def _cfg(root: Path, **preemption: Any) -> CheckpointConfig:
    return CheckpointConfig.from_dict({"root": str(root), "persist": {"fsync": False},
                                       "preemption": {"enabled": True, **preemption}})


@pytest.fixture
def previous_handler():
    """A Python handler installed before the Checkpointer (the user's, or a framework's), restored afterwards."""
    calls: list[int] = []
    called = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        calls.append(signum)
        called.set()

    old = signal.signal(signal.SIGUSR1, handler)
    yield calls, called
    signal.signal(signal.SIGUSR1, old)


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    return model, opt


def test_the_signal_is_recorded_then_the_next_step_saves_flushes_and_chains(tmp_path, previous_handler) -> None:
    calls, called = previous_handler
    model, opt = _trained()
    with Checkpointer(_cfg(tmp_path / "r", signals=["SIGUSR1"], grace_s=30)) as ckpt:
        ckpt.watch(opt)
        ckpt.preemption.on_preempt(lambda: ({"model": model.state_dict()}, 7))
        signal.raise_signal(signal.SIGUSR1)
        assert ckpt.preemption.preempted and calls == []  # only recorded: nothing saved inside the handler
        assert ckpt.list() == []
        want = clone_state({"model": model.state_dict()})
        opt.step()  # the safe point: the step pre-hook saves the state before this step changes it
        assert calls == [signal.SIGUSR1]  # handed on to the handler installed before, once durable
        assert [i.name for i in ckpt.list()] == ["step-000000007-preempt"]
        assert ckpt.latest() == 7
        assert_bit_equal(ckpt.load(), want)
        assert ckpt.preemption.flush_s is not None and ckpt.preemption.final_step == 7
        signal.raise_signal(signal.SIGUSR1)  # a later signal goes straight on
        assert calls == [signal.SIGUSR1, signal.SIGUSR1] and len(ckpt.list()) == 1
    assert signal.getsignal(signal.SIGUSR1) is not None and calls  # close() restored the previous handler
    assert signal.getsignal(signal.SIGUSR1).__name__ == "handler"


def test_point_between_steps_takes_the_final_checkpoint_at_once(tmp_path, previous_handler) -> None:
    calls, _ = previous_handler
    with Checkpointer(_cfg(tmp_path / "r", signals=["SIGUSR1"])) as ckpt:
        state = {"w": torch.arange(10.0)}
        ckpt.preemption.on_preempt(lambda: (state, 3))
        assert ckpt.preemption.point() is False  # no preemption: nothing to do
        signal.raise_signal(signal.SIGUSR1)
        assert ckpt.preemption.point() is True
        assert calls == [signal.SIGUSR1] and ckpt.latest() == 3
        assert_bit_equal(ckpt.load(), state)


def test_without_a_safe_point_the_signal_goes_on_at_the_deadline(tmp_path, previous_handler) -> None:
    calls, called = previous_handler
    with Checkpointer(_cfg(tmp_path / "r", signals=["SIGUSR1"], grace_s=0.2)) as ckpt:
        signal.raise_signal(signal.SIGUSR1)
        # the training thread never reaches a safe point: the watcher hands the signal on, through the main thread
        assert called.wait(30) and calls == [signal.SIGUSR1]
        assert ckpt.preemption.point() is False and ckpt.list() == []


def test_a_notice_file_means_preemption(tmp_path) -> None:
    notice = tmp_path / "notice"
    with Checkpointer(_cfg(tmp_path / "r", signals=[], notice_file=str(notice))) as ckpt:
        ckpt.preemption.on_preempt(lambda: ({"x": torch.ones(3)}, 1))
        assert not ckpt.preemption.wait(0)
        notice.write_text("maintenance at 12:00")
        assert ckpt.preemption.wait(30)
        assert ckpt.preemption.point() is True  # no signal to hand on: the platform ends the process
        assert ckpt.latest() == 1


@pytest.mark.parametrize("bad", [["SIGKILL"], ["SIGNOPE"], "SIGTERM", [9]])
def test_bad_signals_are_refused_naming_the_field(tmp_path, bad) -> None:
    with pytest.raises(ConfigError, match="preemption.signals"):
        CheckpointConfig.from_dict({"root": str(tmp_path), "preemption": {"signals": bad}})


def test_signal_names_are_normalized_and_it_is_off_by_default(tmp_path) -> None:
    cfg = CheckpointConfig.from_dict({"root": str(tmp_path), "preemption": {"signals": ["term", "SIGUSR1"]}})
    assert cfg.preemption.signals == ["SIGTERM", "SIGUSR1"] and cfg.preemption.enabled is False
    before = signal.getsignal(signal.SIGTERM)
    with Checkpointer(cfg):
        assert signal.getsignal(signal.SIGTERM) == before  # disabled: no handler installed


@pytest.mark.slow
@pytest.mark.timeout(900)  # 30 trials: on a loaded 2-core host past the suite's 300 s
def test_plain_loop_30_trials_sigterm_then_sigkill(tmp_path) -> None:
    rng, ctx = random.Random(25), preempt_trials.context()
    trials = [preempt_trials.run_trial("plain", tmp_path / f"t{i}" / "root", rng=rng, ctx=ctx) for i in range(30)]
    for t in trials:  # a 20 s grace always suffices for this small state: every trial is judged exact
        assert not t.killed and t.exitcode == -signal.SIGTERM, t  # the default action went on: never swallowed
        # the checkpoint is the state at the first safe point after the signal: at or after the step the parent had
        # read from the child's pipe (a loaded machine lets the child run a few steps before the parent reads on)
        assert t.recorded_step is not None and t.recorded_step >= t.signal_after, t
        assert t.latest == t.recorded_step and t.exact, t


def test_shm_snapshot_staged_before_sigkill_is_committed_by_the_next_process(tmp_path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    t = preempt_trials.run_trial("plain", tmp_path / "t" / "root", shm_dir=str(shm), rng=random.Random(3))
    assert t.killed and t.exitcode == -signal.SIGKILL, t  # the storage stalled: SIGKILL came before the commit
    assert t.latest == t.recorded_step and t.exact, t  # recovered from shared memory and committed


def test_a_forked_child_inherits_the_handler_but_the_signal_goes_straight_on(tmp_path) -> None:
    from tests.helpers import run_child

    code = """
import multiprocessing as mp, os, signal, sys
import fastckpt
ckpt = fastckpt.Checkpointer(fastckpt.CheckpointConfig.from_dict({"root": sys.argv[1], "preemption": {"enabled": True}}))
def worker():  # a DataLoader worker: fork()ed, with the parent's handler but none of its threads
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(3)  # reached only if the signal was swallowed
p = mp.get_context("fork").Process(target=worker)
p.start(); p.join(60)
print(p.exitcode, ckpt.preemption.preempted)
ckpt.close()
"""
    out = run_child(code, str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(-signal.SIGTERM), "False"], out.stdout  # died of it; the parent saw nothing
