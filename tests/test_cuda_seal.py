"""The seal of lazy snapshots on a real CUDA device: its comparisons run on the GPU, the training thread never waits
for them (``on_mutation: raise``: the committer collects the answer), and a write that skips the version counter is
still refused, at the next ``wait()``, never committed.

Each test widens its window with ``torch.cuda._sleep`` on the copy stream, so the copies land only well after
the seal: a seal that read the staged bytes before they landed, or that waited on the host for them, fails here.
The CPU-side seal tests are tests/test_seal.py and tests/test_mutation_guard.py.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, SnapshotMutatedError
from tests.helpers import assert_bit_equal, clone_state

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

SLEEP = 1_000_000_000  # GPU clock cycles: about half a second on current GPUs


def _setup(n: int = 64):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(n // 2)]).cuda()  # n tensors, big and small
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    x = torch.randn(32, 256, device="cuda")
    return model, opt, x


def _step(model, opt, x) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _warm(ckpt: Checkpointer, model, opt) -> None:
    """One save first: the measured one reuses its page-locked slot (the first allocates it, slowly on some hosts)."""
    ckpt.save({"m": model.state_dict(), "o": opt.state_dict()}, step=0).wait(timeout=120)


def test_the_seal_does_not_wait_on_the_host_for_the_copies(tmp_path) -> None:
    model, opt, x = _setup()
    _step(model, opt, x)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        _warm(ckpt, model, opt)
        state = {"m": model.state_dict(), "o": opt.state_dict()}
        ref = clone_state(state)
        lazy = ckpt._streams.lazy(0)
        with torch.cuda.stream(lazy):
            torch.cuda._sleep(SLEEP)  # the lazy copies queue behind this
        h = ckpt.save(state, step=1)
        t0 = time.perf_counter()
        _step(model, opt, x)  # the pre-hook: wait_staged + the seal, both only queued on the GPU
        host_s = time.perf_counter() - t0
        assert not lazy.query(), "the copy stream was idle already: the test proves nothing"
        assert h.stats.gpu_waits >= 1, "the step was not ordered after copies still running"
        assert host_s < 0.25, f"the step's host time {host_s:.3f}s includes waiting for the copies (~0.5 s)"
        h.wait(timeout=120)
        assert_bit_equal(ref, ckpt.load(step=1))


@pytest.mark.parametrize("undone", [False, True])
def test_a_write_through_data_after_save_is_refused_not_committed(tmp_path, undone) -> None:
    """An EMA swap through ``.data`` (no version bump) after save(); undone before the step or not."""
    model, opt, x = _setup()
    _step(model, opt, x)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        _warm(ckpt, model, opt)
        w = model[3].weight
        backup = w.detach().clone()
        lazy = ckpt._streams.lazy(0)
        with torch.cuda.stream(lazy):
            # the copies read after the swap below (and, undone, long before the swap back)
            torch.cuda._sleep(SLEEP // 2 if undone else SLEEP)
        h = ckpt.save({"m": model.state_dict(), "o": opt.state_dict()}, step=1)
        w.data.copy_(torch.zeros_like(w))  # skips the version counter: only the sampled bytes can tell
        if undone:
            torch.cuda._sleep(SLEEP)  # on the training stream: the swap back lands after the copies read
            w.data.copy_(backup)  # swapped back before the seal: only the staged bytes differ from save()'s
        _step(model, opt, x)  # the seal
        with pytest.raises(SnapshotMutatedError, match=r"'m/3\.weight'"):
            h.wait(timeout=120)
        assert [c.step for c in ckpt.list()] == [0], "the refused checkpoint was committed"
        ckpt.save({"m": model.state_dict(), "o": opt.state_dict()}, step=2).wait(timeout=120)  # goes on


def test_retake_decides_at_the_seal_and_saves_the_values_at_the_seal(tmp_path) -> None:
    model, opt, x = _setup()
    _step(model, opt, x)
    cfg = CheckpointConfig(root=str(tmp_path), staging={"on_mutation": "retake"})
    with Checkpointer(cfg) as ckpt:
        ckpt.watch(opt)
        _warm(ckpt, model, opt)
        w = model[3].weight
        lazy = ckpt._streams.lazy(0)
        with torch.cuda.stream(lazy):
            torch.cuda._sleep(SLEEP)
        state = {"m": model.state_dict(), "o": opt.state_dict()}
        h = ckpt.save(state, step=1)
        w.data.mul_(0.5)  # not undone: the retake takes the values at the seal
        at_seal = clone_state({"m": model.state_dict(), "o": opt.state_dict()})
        ckpt.wait_staged()  # the seal, as the step's pre-hook would
        h.wait(timeout=120)
        assert_bit_equal(at_seal, ckpt.load(step=1))
