"""The seal of lazy snapshots: writes outside step(), with or without a version bump, never commit silently.

The copy thread is held deterministically as in test_mutation_guard.py: host memory is bounded to two ring
buffers and ``GatedStorage`` holds the writes that would hand them back, so the last two shards are copied only
once the test opens the gate; ``_Counting`` tells when all four shard writes have been handed over (every copy
done). Every wait is bounded (tests/helpers.py), so a refused snapshot that hangs the ring fails the test.
"""
from __future__ import annotations

import threading
from typing import Sequence

import pytest
import torch
from torch import nn

from fastckpt import Checkpointer, CheckpointConfig, RetakenSnapshotWarning, SnapshotMutatedError
from fastckpt.engine.once import WARNED
from fastckpt.storage.protocol import open_storage
from tests.helpers import GatedStorage, assert_bit_equal, bounded, clone_state

_N = 1024  # float32 elements: one 4096-byte tensor per shard


class _Counting(GatedStorage):
    """``GatedStorage`` that also sets ``copied`` once the fourth shard write of a save is handed over."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.copied = threading.Event()
        self._shards = 0
        self._lock = threading.Lock()

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        if path.endswith(".safetensors"):
            with self._lock:
                self._shards += 1
                if self._shards % 4 == 0:
                    self.copied.set()
        super().write_file(path, parts)


def _setup(tmp_path, on_mutation: str = "raise") -> tuple[Checkpointer, _Counting]:
    inner = _Counting(open_storage(str(tmp_path)))
    staging = {"mode": "lazy", "max_host_bytes": 2 * 4 * _N}
    if on_mutation != "raise":  # "raise" is the default
        staging["on_mutation"] = on_mutation
    cfg = CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 4 * _N, "workers": 4}, staging=staging)
    return Checkpointer(cfg, storage=inner), inner


def _model() -> nn.ParameterDict:
    torch.manual_seed(0)
    return nn.ParameterDict({f"p{i}": nn.Parameter(torch.randn(_N)) for i in range(4)})


def _state(model: nn.ParameterDict) -> dict:
    return {"model": model.state_dict()}


def _step(model: nn.ParameterDict, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    sum(p.pow(2).sum() for p in model.values()).backward()
    opt.step()  # its pre-hook seals the pending snapshot


def _parked_save(ckpt: Checkpointer, gated: _Counting, model: nn.ParameterDict, step: int):
    """save() with the copy thread parked before the last two shards ("p2", "p3")."""
    gated.gate.clear()
    gated.copied.clear()
    ref = clone_state(_state(model))
    handle = ckpt.save(_state(model), step=step)
    return handle, ref


def test_data_write_before_the_copy_is_refused(tmp_path) -> None:
    """WGAN clipping through .data right after save(): no version bump, the copy reads the clipped values."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt, gated = _setup(tmp_path)
    with ckpt:
        ckpt.watch(opt)
        handle, _ = _parked_save(ckpt, gated, model, 1)
        model["p3"].data.clamp_(-0.01, 0.01)  # skips the version counter
        gated.gate.set()
        bounded(lambda: _step(model, opt), 30)  # the seal: refuses, training goes on
        with pytest.raises(SnapshotMutatedError) as info:
            bounded(handle.wait, 30)
        msg = str(info.value)
        assert "model/p3" in msg and ".data" in msg and "step-000000001" in msg, msg
        assert ckpt.list() == []  # nothing silently wrong was committed
        bounded(lambda: ckpt.save(_state(model), step=2).wait(), 30)  # raised once: saving goes on


def test_data_ema_swap_during_the_copy_is_refused(tmp_path) -> None:
    """EMA swapped in through .data while the copy runs, swapped back before the step: sources look untouched,
    the staged bytes do not. The ring is held by the refused snapshot's buffers only until its writes end."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt, gated = _setup(tmp_path)
    with ckpt:
        ckpt.watch(opt)
        for step in range(1, 4):
            handle, ref = _parked_save(ckpt, gated, model, step)
            backup = {k: p.detach().clone() for k, p in model.items()}
            for p in model.values():
                p.data.copy_(torch.zeros(_N))  # the EMA weights, for evaluation
            gated.gate.set()
            assert gated.copied.wait(30)  # p2 and p3 were copied while the EMA weights were in
            for k, p in model.items():
                p.data.copy_(backup[k])
            bounded(lambda: _step(model, opt), 30)
            with pytest.raises(SnapshotMutatedError, match="model/p[23]"):
                bounded(handle.wait, 30)
        assert ckpt.list() == []


@pytest.mark.parametrize("on_mutation", ["raise", "retake"])
def test_ema_swap_in_place_never_commits_ema_values(tmp_path, on_mutation: str) -> None:
    """The issue's loop: p.copy_(ema), evaluate, p.copy_(backup) right after each of 10 lazy saves, unheld."""
    model = _model()
    ema = {k: torch.zeros(_N) for k in model}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt, gated = _setup(tmp_path, on_mutation)
    gated.gate.set()
    refs, handles = {}, {}
    with ckpt:
        ckpt.watch(opt)
        for step in range(1, 11):
            _step(model, opt)
            refs[step] = clone_state(_state(model))
            try:
                handles[step] = ckpt.save(_state(model), step=step)
            except SnapshotMutatedError:  # the refusal of an earlier save, raised once: this one goes on
                assert on_mutation == "raise"
                handles[step] = ckpt.save(_state(model), step=step)
            with torch.no_grad():
                backup = {k: p.clone() for k, p in model.items()}
                for k, p in model.items():
                    p.copy_(ema[k])
                sum(p.sum() for p in model.values())  # evaluate
                for k, p in model.items():
                    p.copy_(backup[k])
        for step, handle in handles.items():
            try:
                bounded(handle.wait, 30)
            except SnapshotMutatedError:
                assert on_mutation == "raise"
        committed = [i.step for i in ckpt.list()]
        if on_mutation == "retake":  # retaken at the step's seal: the swap was undone, so save()'s values
            assert committed == list(range(1, 11))
        for step in committed:
            assert_bit_equal(refs[step], ckpt.load(step))


def test_retake_holds_the_seal_values_then_stages_moved_keys_eagerly(tmp_path, recwarn) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt, gated = _setup(tmp_path, "retake")
    with ckpt:
        ckpt.watch(opt)
        handle, ref = _parked_save(ckpt, gated, model, 1)
        model["p3"].data.clamp_(-0.01, 0.01)  # WGAN clipping through .data
        gated.gate.set()
        at_seal = clone_state(_state(model))  # what the retake takes: save()'s values but the clipped p3
        bounded(lambda: _step(model, opt), 30)
        bounded(handle.wait, 30)  # retaken under the same handle: it commits
        got = ckpt.load(1)
        assert_bit_equal(at_seal, got)
        for k in ("p0", "p1", "p2"):
            assert torch.equal(got["model"][k], ref["model"][k])
        # from now on p3 is copied inside save(): the same write after the next save is harmless
        handle, ref = _parked_save(ckpt, gated, model, 2)
        model["p3"].data.clamp_(-0.001, 0.001)
        gated.gate.set()
        bounded(lambda: _step(model, opt), 30)
        bounded(handle.wait, 30)
        assert_bit_equal(ref, ckpt.load(2))
        warned = [w for w in recwarn if issubclass(w.category, RetakenSnapshotWarning)]
        assert len(warned) <= 1  # once per process (another test of this process may have taken it)
        assert [i.step for i in ckpt.list()] == [1, 2]


def test_a_retake_is_announced_as_a_named_warning_filters_can_turn_into_an_error(tmp_path) -> None:
    """Issue 55, item 6: the retake is a ``RetakenSnapshotWarning`` (exported as ``fastckpt.RetakenSnapshotWarning``),
    not only a line on stderr, so ``pytest.warns``, warning filters and ``logging.captureWarnings`` see it. With the
    filter set to "error" the step that sealed it raises it, and the checkpoint is retaken and commits all the
    same (the warning is raised after the retake). Before: a log record on the "fastckpt" logger, no warning."""
    import fastckpt
    import warnings

    assert fastckpt.RetakenSnapshotWarning is RetakenSnapshotWarning and issubclass(RetakenSnapshotWarning, UserWarning)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt, gated = _setup(tmp_path, "retake")
    WARNED.reset()  # once per process: another test of this process may have said it
    with ckpt:
        ckpt.watch(opt)
        handle, _ = _parked_save(ckpt, gated, model, 1)
        model["p3"].data.clamp_(-0.01, 0.01)  # an EMA-like write through .data: no version bump
        gated.gate.set()
        at_seal = clone_state(_state(model))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RetakenSnapshotWarning)
            with pytest.raises(RetakenSnapshotWarning, match=r"'model/p3' changed after save.*taken again"):
                bounded(lambda: _step(model, opt), 30)
        bounded(handle.wait, 30)
        assert_bit_equal(at_seal, ckpt.load(1))  # retaken at the seal although the warning was raised
        # said once per process: a second retake of another tensor is not announced again
        handle, _ = _parked_save(ckpt, gated, model, 2)
        model["p2"].data.clamp_(-0.01, 0.01)
        gated.gate.set()
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            bounded(lambda: _step(model, opt), 30)
            bounded(handle.wait, 30)
        assert not [w for w in again if issubclass(w.category, RetakenSnapshotWarning)]
        assert [i.step for i in ckpt.list()] == [1, 2]


def test_a_data_write_into_a_sampled_tensor_is_refused(tmp_path) -> None:
    """A tensor over ``WHOLE`` bytes is compared by strided samples, not whole: a ``.data`` write of all of it right
    after save() (whether the copy read it before or after) is refused at the seal, and the next save commits."""
    from fastckpt.engine.seal import WHOLE

    torch.manual_seed(0)
    big = nn.Parameter(torch.randn(4 * WHOLE))  # 1 MiB of float32: sampled every page
    opt = torch.optim.SGD([big], lr=0.1)
    with Checkpointer(CheckpointConfig(root=str(tmp_path), staging={"mode": "lazy"})) as ckpt:
        ckpt.watch(opt)
        handle = ckpt.save({"big": big}, step=1)
        big.data.mul_(2.0)  # skips the version counter
        with pytest.raises(SnapshotMutatedError, match="'big'"):
            bounded(handle.wait, 30)
        assert ckpt.list() == []
        ref = big.detach().clone()
        bounded(lambda: ckpt.save({"big": big}, step=2).wait(), 30)
        assert torch.equal(ckpt.load(2)["big"], ref)


def test_the_sampling_stride_keeps_a_save_within_its_budget() -> None:
    """One run per page while the lazy bytes are few; beyond that the stride doubles so that a save samples at most
    ``BUDGET`` runs (each run is a page touch: one per page of 1.48 GB cost 115 ms inside save())."""
    from fastckpt.engine.seal import BUDGET, PAGE, stride_for

    assert stride_for(0) == PAGE and stride_for(BUDGET * PAGE) == PAGE
    for total in (BUDGET * PAGE + 1, 1_483_841_100, 80 * 1024 ** 3):
        stride = stride_for(total)
        assert stride & (stride - 1) == 0 and total // stride <= BUDGET < total // (stride // 2), (total, stride)
