"""The snapshot contract: saved bytes equal the values at the moment save() was called."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fastckpt.storage.protocol import open_storage
from fastckpt import Checkpointer, CheckpointConfig
from tests.helpers import GatedStorage, assert_bit_equal, clone_state


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 8))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("opt_kind", ["adamw_foreach", "adamw_fused", "sgd_momentum"])
def test_mutation_race_with_watch(tmp_path, opt_kind: str) -> None:
    """forward/backward/step right after save(), no explicit wait: saved = values at save()."""
    model = _model()
    if opt_kind == "adamw_foreach":
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    elif opt_kind == "adamw_fused":
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)  # does not bump _version
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(16, 32)
    inner = GatedStorage(open_storage(str(tmp_path)))
    with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 4096}), storage=inner) as ckpt:
        ckpt.watch(opt)
        _train_step(model, opt, x)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        ref = clone_state(state)
        handle = ckpt.save(state, step=1)
        # the copies run lazily; writes are held so nothing is persisted yet
        for _ in range(3):
            _train_step(model, opt, x)  # step pre-hook waits for staging, then mutates
        assert not torch.equal(model[0].weight, ref["model"]["0.weight"]), "training did not change weights"
        inner.gate.set()
        handle.wait()
        loaded = ckpt.load()
    assert_bit_equal(ref, loaded)


def test_lazy_copy_really_is_deferred(tmp_path) -> None:
    """Parameters are not copied inside save(): staging completes on the copy thread."""
    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = GatedStorage(open_storage(str(tmp_path)))
    with Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=inner) as ckpt:
        ckpt.watch(opt)
        h = ckpt.save({"m": model.state_dict()}, step=0)
        plan = ckpt._planner._cache[next(iter(ckpt._planner._cache))]
        assert all(e.lazy for e in plan.entries)
        h.wait_staged()
        inner.gate.set()
        assert h.staged() and not h.done()  # staged on the copy thread, write still held
        h.wait()
        assert h.done() and h.stats.persist_s * 1e3 >= h.stats.staging_ms >= h.stats.blocking_ms


def test_batchnorm_stats_are_copied_eagerly(tmp_path) -> None:
    """A forward right after save() must not leak new running stats into the checkpoint."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inner = GatedStorage(open_storage(str(tmp_path)))
    with Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=inner) as ckpt:
        ckpt.watch(opt)
        _train_step(model, opt, torch.randn(16, 32))
        state = {"model": model.state_dict()}
        ref = clone_state(state)
        h = ckpt.save(state, step=1)
        model(torch.randn(16, 32) * 5 + 3)  # changes running_mean/var/num_batches_tracked in place
        assert not torch.equal(model[1].running_mean, ref["model"]["1.running_mean"])
        inner.gate.set()
        h.wait()
        assert_bit_equal(ref, ckpt.load())


def test_eager_mode_allows_any_inplace_change(tmp_path) -> None:
    params = {"w": torch.randn(64, 64)}
    ref = clone_state(params)
    cfg = CheckpointConfig(root=str(tmp_path), staging={"mode": "eager"})
    with Checkpointer(cfg) as ckpt:
        h = ckpt.save(params, step=0)
        assert h.staged()  # eager: staged before save() returns
        params["w"].add_(1.0)  # a hand-made update, no optimizer involved
        h.wait()
        assert_bit_equal(ref, ckpt.load())


def test_unwatched_tensors_are_copied_eagerly(tmp_path) -> None:
    """Tensors the core cannot classify are copied inside save()."""
    w = torch.randn(32, 32)
    ref = w.clone()
    inner = GatedStorage(open_storage(str(tmp_path)))
    with Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=inner) as ckpt:
        h = ckpt.save({"w": w}, step=0)
        assert h.staged()
        w.mul_(3)
        inner.gate.set()
        h.wait()
        assert torch.equal(ckpt.load()["w"], ref)


def test_plan_cache_and_arena_reuse(tmp_path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 32)
    _train_step(model, opt, x)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        ckpt.save({"m": model.state_dict(), "o": opt.state_dict()}, step=1).wait()
        first = ckpt.counters
        for step in range(2, 6):
            _train_step(model, opt, x)
            ckpt.save({"m": model.state_dict(), "o": opt.state_dict()}, step=step).wait()
        assert ckpt.counters == first, "a second save of the same structure re-planned or allocated"
        assert first["plans_built"] == 1
        # a different structure is a new plan
        ckpt.save({"other": torch.zeros(3)}, step=9).wait()
        assert ckpt.counters["plans_built"] == 2


def test_when_busy_skip_reports_on_handle(tmp_path) -> None:
    inner = GatedStorage(open_storage(str(tmp_path)))
    cfg = CheckpointConfig(root=str(tmp_path), staging={"slots": 1, "when_busy": "skip"})
    with Checkpointer(cfg, storage=inner) as ckpt:
        first = ckpt.save({"w": torch.ones(4)}, step=1)
        second = ckpt.save({"w": torch.ones(4)}, step=2)
        assert second.skipped and second.stats.skipped and not first.skipped
        assert second.wait() is None
        inner.gate.set()
        first.wait()
        assert ckpt.latest() == 1


def test_when_busy_wait_blocks_until_a_slot_frees(tmp_path) -> None:
    import threading

    inner = GatedStorage(open_storage(str(tmp_path)))
    cfg = CheckpointConfig(root=str(tmp_path), staging={"slots": 1, "when_busy": "wait"})
    with Checkpointer(cfg, storage=inner) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1)
        done = threading.Event()
        t = threading.Thread(target=lambda: (ckpt.save({"w": torch.ones(4)}, step=2), done.set()))
        t.start()
        assert inner.entered.wait(10)
        assert not done.is_set()  # blocked on the busy slot while the first write is held
        inner.gate.set()
        t.join(30)
        assert done.is_set()
        ckpt.wait()
        assert [i.step for i in ckpt.list()] == [1, 2]


def test_bounded_host_memory_streams_in_chunks(tmp_path) -> None:
    """State 4x larger than max_host_bytes: staged through a ring, never allocated whole."""
    state = {f"t{i}": torch.randn(64, 1024) for i in range(8)}  # 8 x 256 KiB = 2 MiB
    ref = clone_state(state)
    cfg = CheckpointConfig(root=str(tmp_path), staging={"max_host_bytes": 512 * 1024, "mode": "eager"},
                           persist={"chunk_bytes": 256 * 1024})
    with Checkpointer(cfg) as ckpt:
        ckpt.save(state, step=0).wait()
        assert ckpt.counters["host_bytes"] <= 512 * 1024
        ckpt.save(state, step=1).wait()
        assert ckpt.counters["host_bytes"] <= 512 * 1024
        assert_bit_equal(ref, ckpt.load())


def test_bounded_host_memory_with_lazy_copies(tmp_path) -> None:
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(4, 128)
    cfg = CheckpointConfig(root=str(tmp_path), staging={"max_host_bytes": 200_000},
                           persist={"chunk_bytes": 70_000})
    with Checkpointer(cfg) as ckpt:
        ckpt.watch(opt)
        state = {"m": model.state_dict()}
        ref = clone_state(state)
        h = ckpt.save(state, step=0)
        _train_step(model, opt, x)
        h.wait()
        assert ckpt.counters["host_bytes"] <= 200_000
        assert_bit_equal(ref, ckpt.load())


def test_plan_is_reused_when_only_names_change(tmp_path) -> None:
    """Lightning keys best_k_models by file path: new names every save must not re-plan."""
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        for step in range(4):
            state = {"w": torch.full((8,), float(step)), "best": {f"epoch={step}.ckpt": torch.tensor(step * 1.0)}}
            ckpt.save(state, step=step).wait()
            assert_bit_equal(state, ckpt.load(step=step))
        assert ckpt.counters["plans_built"] == 1


def test_waited_ms_records_the_stall_of_the_step_hook(tmp_path, monkeypatch) -> None:
    """stats.waited_ms is the time the optimizer pre-hook spent blocked on this save's lazy copy."""
    import threading

    import fastckpt.engine.pipeline as pipeline

    release = threading.Event()
    copying = threading.Event()
    real_copy = pipeline.Pipeline._copy_into  # a shard's copy, whichever way it copies (engine/onepass.py)

    def held_copy(*args, **kwargs):  # the copy thread parks here until the test releases it
        copying.set()
        assert release.wait(30)
        return real_copy(*args, **kwargs)

    monkeypatch.setattr(pipeline.Pipeline, "_copy_into", held_copy)
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # the plain copy (staging.crc_in_copy: false), the function parked here; the one pass stalls the hook alike
    with Checkpointer(CheckpointConfig(root=str(tmp_path), staging={"crc_in_copy": False})) as ckpt:
        ckpt.watch(opt)
        h = ckpt.save({"m": model.state_dict()}, step=0)
        assert copying.wait(30)
        timer = threading.Timer(0.2, release.set)  # the stall to be measured: at least 200 ms
        timer.start()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()  # pre-hook blocks until the copy is released
        timer.join()
        h.wait()
        waited = h.stats.waited_ms
        assert waited >= 150, waited
        opt.step()  # staged already: no further wait is booked
        assert h.stats.waited_ms == waited
        assert ckpt.stats[-1].as_dict()["waited_ms"] == waited
