"""Flush on preemption through the integrations: 10 SIGTERM-then-SIGKILL trials each for Lightning (chained to
Lightning's own SIGTERM handler) and Accelerate (chained to the default action); tests/preempt_frontends.py."""
from __future__ import annotations

import random
import signal

import pytest

from tests import preempt_frontends, preempt_trials  # noqa: F401 - preempt_frontends registers the children


def _trials(kind: str, tmp_path, n: int) -> list[preempt_trials.Trial]:
    rng, ctx = random.Random(25), preempt_trials.context()
    return [preempt_trials.run_trial(kind, tmp_path / f"t{i}" / "root", rng=rng, ctx=ctx) for i in range(n)]


@pytest.mark.slow
def test_lightning_10_trials_sigterm_then_sigkill(tmp_path) -> None:
    for t in _trials("lightning", tmp_path, 10):
        # Lightning's handler ran after ours (it stops the fit: the child exits by itself, before any SIGKILL)
        assert not t.killed and t.exitcode == 0, t
        assert t.recorded_step is not None and t.recorded_step >= t.signal_after, t
        assert t.latest == t.recorded_step and t.exact, t  # the newest .ckpt is the state at the signal


@pytest.mark.slow
def test_accelerate_10_trials_sigterm_then_sigkill(tmp_path) -> None:
    for t in _trials("accelerate", tmp_path, 10):
        assert not t.killed and t.exitcode == -signal.SIGTERM, t  # the default action went on: never swallowed
        assert t.recorded_step is not None and t.recorded_step >= t.signal_after, t  # the pipe may lag under load
        assert t.latest == t.recorded_step and t.exact, t
