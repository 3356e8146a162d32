"""The lazy-snapshot mutation guard: a watched tensor changed outside optimizer.step() fails that save.

The copy thread is held deterministically: host memory is bounded to two ring buffers, and
``GatedStorage`` holds the writes that would hand them back, so the trailing shards cannot be
copied until the test opens the gate. A change made before that lands between save() and the copy.
"""
from __future__ import annotations

import threading
from typing import Callable

import pytest
import torch
from torch import nn

from fastckpt import Checkpointer, CheckpointConfig, SnapshotMutatedError
from fastckpt.storage.protocol import open_storage
from tests import passpaths
from tests.helpers import GatedStorage, assert_bit_equal, clone_state

_N = 1024  # float32 elements: one 4096-byte tensor per shard (the smallest chunk_bytes)


def _setup(tmp_path, mode: str = "lazy", one_pass: bool = True) -> tuple[Checkpointer, GatedStorage]:
    inner = GatedStorage(open_storage(str(tmp_path)))
    cfg = CheckpointConfig(root=str(tmp_path), staging={"mode": mode, "max_host_bytes": 2 * 4 * _N,
                                                        "crc_in_copy": one_pass},
                           persist={"chunk_bytes": 4 * _N})
    return Checkpointer(cfg, storage=inner), inner


def _model() -> nn.ParameterDict:
    torch.manual_seed(0)
    return nn.ParameterDict({f"p{i}": nn.Parameter(torch.randn(_N)) for i in range(4)})


def _state(model: nn.ParameterDict, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _step(model: nn.ParameterDict, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    sum(p.pow(2).sum() for p in model.values()).backward()
    opt.step()


def _ema_swap(model, opt) -> None:
    with torch.no_grad():
        model["p3"].copy_(torch.zeros(_N))  # EMA weights swapped into the model for evaluation


def _clamp(model, opt) -> None:
    with torch.no_grad():
        model["p3"].clamp_(-0.1, 0.1)


def _surgery(model, opt) -> None:
    with torch.no_grad():
        model["p3"].mul_(0.5)


def _reset_moments(model, opt) -> None:
    for st in opt.state.values():
        st["exp_avg"].zero_()  # optimizer state changed by a callback


@pytest.mark.parametrize("mutate", [_ema_swap, _clamp, _surgery, _reset_moments],
                         ids=["ema_swap", "clamp", "weight_surgery", "optimizer_state"])
def test_change_outside_step_fails_that_checkpoint(tmp_path, mutate: Callable) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1, foreach=True)
    ckpt, gated = _setup(tmp_path)
    with ckpt:
        ckpt.watch(opt)
        _step(model, opt)
        gated.gate.set()
        good = clone_state(_state(model, opt))
        ckpt.save(_state(model, opt), step=1).wait()
        gated.gate.clear()
        _step(model, opt)
        handle = ckpt.save(_state(model, opt), step=2)
        mutate(model, opt)  # the copy thread is parked on the ring: this lands before its copy
        gated.gate.set()
        with pytest.raises(SnapshotMutatedError) as info:
            handle.wait()
        msg = str(info.value)
        assert "step-000000002" in msg and "staging.mode: eager" in msg
        assert ("model/p3" in msg) or ("optim/state/" in msg and "exp_avg" in msg), msg
        assert [i.step for i in ckpt.list()] == [1]  # the failed save left nothing; the good one is intact
        assert_bit_equal(good, ckpt.load(1))
        ckpt.save(_state(model, opt), step=3).wait()  # the error was raised once; saving goes on
        assert [i.step for i in ckpt.list()] == [1, 3]


def test_error_is_raised_once_at_the_next_save(tmp_path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt, gated = _setup(tmp_path)
    with ckpt:
        ckpt.watch(opt)
        ckpt.save(_state(model, opt), step=1)
        _clamp(model, opt)
        gated.gate.set()
        ckpt.wait_staged()  # the seal (as the step's pre-hook would): finds the change, records the error
        with pytest.raises(SnapshotMutatedError, match="model/p3"):
            ckpt.save(_state(model, opt), step=2)
        ckpt.save(_state(model, opt), step=3).wait()  # raised once: saving goes on
        assert [i.step for i in ckpt.list()] == [3]


def test_eager_mode_allows_the_same_change(tmp_path) -> None:
    """The documented fix: staging.mode eager copies inside save(), so the change is harmless."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt, gated = _setup(tmp_path, mode="eager")
    gated.gate.set()  # save() itself stages through the ring, so its writes must flow
    with ckpt:
        ckpt.watch(opt)
        state = _state(model, opt)
        ref = clone_state(state)
        handle = ckpt.save(state, step=1)
        _ema_swap(model, opt)
        handle.wait()
        assert_bit_equal(ref, ckpt.load(1))


@pytest.mark.parametrize("kind", ["foreach", "forloop", "fused", "sgd_momentum"])
def test_no_false_positive_from_the_optimizer_step(tmp_path, kind: str) -> None:
    """The step that runs right after save() waits for the copy: every save commits the values at save()."""
    model = _model()
    if kind == "sgd_momentum":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, **{kind: True} if kind != "forloop" else {"foreach": False})
    ckpt, gated = _setup(tmp_path)
    gated.gate.set()
    with ckpt:
        ckpt.watch(opt)
        refs, handles = [], []
        for step in range(6):
            _step(model, opt)
            state = _state(model, opt)
            refs.append(clone_state(state))
            handles.append(ckpt.save(state, step=step))  # the next _step runs at once; its hook waits
        for h in handles:
            h.wait()
        for step, ref in enumerate(refs):
            assert_bit_equal(ref, ckpt.load(step))


@pytest.mark.parametrize("path", passpaths.PATHS)
@pytest.mark.parametrize("one_pass", [False, True])
def test_change_landing_during_the_copy_is_caught_after_it(tmp_path, monkeypatch, one_pass: bool, path: str) -> None:
    """A write that lands while its tensor is being copied (after the check before the copy) fails the save too."""
    import fastckpt.engine.onepass as onepass
    import fastckpt.engine.pipeline as pipeline

    passpaths.use(monkeypatch, path)
    module, name = (onepass, "copy_with_health") if one_pass else (pipeline, "copy_entries")

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real_copy = getattr(module, name)

    def write_p2(sources) -> None:
        if any(t.data_ptr() == model["p2"].data_ptr() for t in sources):
            with torch.no_grad():
                model["p2"].add_(1.0)  # p2 was just copied; its after-copy check must see this

    def copy_then_write(buf, entries, tensors, *rest):  # the "concurrent" write, deterministically placed
        def each():
            for e in entries:
                yield e
                write_p2([tensors[e.index]])
        return real_copy(buf, each(), tensors, *rest)

    if path in ("batched", "compiled"):
        passpaths.around_fill(monkeypatch, lambda sources: None, write_p2)
    else:
        monkeypatch.setattr(module, name, copy_then_write)
    ckpt, gated = _setup(tmp_path, one_pass=one_pass)
    gated.gate.set()
    with ckpt:
        ckpt.watch(opt)
        handle = ckpt.save(_state(model, opt), step=1)
        assert handle._staged.wait(30)  # staged with no caller waiting: no shard is staged plainly in a hurry
        with pytest.raises(SnapshotMutatedError, match="model/p2"):
            handle.wait()
        assert ckpt.list() == []


@pytest.mark.parametrize("path", passpaths.PATHS)
@pytest.mark.parametrize("one_pass", [False, True])
def test_a_write_whose_counter_moves_after_the_copy_checks_is_caught_before_staging_ends(tmp_path, monkeypatch,
                                                                                         one_pass: bool,
                                                                                         path: str) -> None:
    """An in-place kernel bumps the version counter only once it has written: a copy that reads a tensor while it
    is being written passes that tensor's checks when the bump comes after them. Here the write lands through
    ``.data`` (no bump) right before ``p1`` is copied, and the counter moves only after ``p1``'s after-copy check,
    while ``p2`` is copied: the snapshot holding the new ``p1`` must be refused, not committed silently."""
    import fastckpt.engine.onepass as onepass
    import fastckpt.engine.pipeline as pipeline

    passpaths.use(monkeypatch, path)
    module, name = (onepass, "copy_with_health") if one_pass else (pipeline, "copy_entries")

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    real_copy = getattr(module, name)

    def race(sources) -> None:
        if any(t.data_ptr() == model["p1"].data_ptr() for t in sources):
            model["p1"].data.copy_(torch.zeros(_N))  # the kernel writes: the counter has not moved yet
        if any(t.data_ptr() == model["p2"].data_ptr() for t in sources):  # p1 was copied, checked, unmoved
            with torch.no_grad():
                model["p1"].add_(0.0)  # ... and now its counter moves, as the kernel ends

    def racing_copy(buf, entries, tensors, *rest):  # the kernel's write and its late bump, deterministically placed
        def each():
            for e in entries:
                race([tensors[e.index]])
                yield e
        return real_copy(buf, each(), tensors, *rest)

    if path in ("batched", "compiled"):
        passpaths.around_fill(monkeypatch, race, lambda sources: None)
    else:
        monkeypatch.setattr(module, name, racing_copy)
    ckpt, gated = _setup(tmp_path, one_pass=one_pass)
    gated.gate.set()
    with ckpt:
        ckpt.watch(opt)
        handle = ckpt.save(_state(model, opt), step=1)
        assert handle._staged.wait(30)  # staged with no caller waiting: no shard is staged plainly in a hurry
        with pytest.raises(SnapshotMutatedError, match="model/p1"):
            handle.wait()
        assert ckpt.list() == [], "the snapshot holding the half-swapped p1 was committed"



def test_an_inference_tensor_in_a_lazy_save_is_saved_without_a_counter(tmp_path) -> None:
    """Inference tensors keep no version counter (reading it raises): the guard leaves them to the seal's samples
    and the save restores bit for bit; the other lazy tensors are still guarded."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.inference_mode():
        frozen = torch.randn(_N)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        state = {**_state(model, opt), "frozen": frozen}
        want = clone_state(state)
        ckpt.save(state, step=1, lazy=["frozen"]).wait()
        assert_bit_equal(want, ckpt.load(1))
        handle = ckpt.save(state, step=2)
        with torch.no_grad():
            model["p0"].add_(1.0)  # a guarded tensor changed before the seal: still refused
        with pytest.raises(SnapshotMutatedError, match="model/p0"):
            handle.wait()
