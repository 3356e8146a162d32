"""Issue 53, item 4: the first checkpoint costs what the others cost (``Checkpointer.prewarm``, engine/prewarm.py).

``prewarm(state)`` makes the staging buffers of ``state``'s plan in the background; the first save then makes none
(the host allocation counters do not move), and restores bit for bit. A slot that host memory cannot hold is refused
with a ConfigError naming ``staging.max_host_bytes``, before anything is made; in ring mode only the ring is made.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fastckpt.engine.prewarm as prewarm
from fastckpt import CheckpointConfig, Checkpointer, ConfigError
from fastckpt.engine.staging import HostArena
from tests.helpers import assert_bit_equal, clone_state


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.LayerNorm(512), nn.Linear(512, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


@pytest.mark.parametrize("lazy", [True, False])
def test_after_prewarm_the_first_save_makes_no_buffer(tmp_path, lazy: bool) -> None:
    model, opt = _trained()
    with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 1 << 18})) as ck:
        if lazy:
            ck.watch(opt)
        state = _state(model, opt)
        made = ck.prewarm(state).result(timeout=60)
        counters = ck.counters
        assert made == counters["host_bytes"] > 0 and counters["host_allocations"] > 1  # several shards
        want = clone_state(state)
        ck.save(state, 1).wait()
        assert ck.counters == counters, "the first save made buffers prewarm() should have made"
        assert ck.prewarm(state).result(timeout=60) == 0  # made once
        assert_bit_equal(want, ck.load(1))


def test_a_slot_host_memory_cannot_hold_is_refused_before_anything_is_made(tmp_path, monkeypatch) -> None:
    model, opt = _trained()
    monkeypatch.setattr(prewarm.psutil, "virtual_memory", lambda: SimpleNamespace(available=1 << 20))
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ck:
        ck.watch(opt)
        state = _state(model, opt)
        with pytest.raises(ConfigError, match="staging.max_host_bytes"):
            ck.prewarm(state)
        assert ck.counters["host_allocations"] == 0
        want = clone_state(state)
        ck.save(state, 1).wait()  # the refusal left nothing behind: saves go on
        assert_bit_equal(want, ck.load(1))


def test_ring_mode_prewarms_the_ring_only(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])  # 16 weights of one shard each
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    chunk = 1 << 18
    cfg = CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": chunk},
                           staging={"max_host_bytes": 3 * chunk})
    with Checkpointer(cfg) as ck:
        ck.watch(opt)
        state = _state(model, opt)
        made = ck.prewarm(state).result(timeout=60)
        total = sum(t.numel() * t.element_size() for part in state.values() for t in _tensors(part))
        assert 0 < made <= 3 * chunk and made < total / 10, (made, total)  # the ring's buffers, not the state
        counters = ck.counters
        want = clone_state(state)
        ck.save(state, 1).wait()
        assert ck.counters == counters
        assert_bit_equal(want, ck.load(1))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_close_waits_for_a_prewarm_in_flight(tmp_path, monkeypatch) -> None:
    """close() while prewarm() is making buffers: the prewarming thread ends before the arena drops them."""
    model, opt = _trained()
    entered, release = threading.Event(), threading.Event()
    real = HostArena._make

    def slow_make(self, *args, **kwargs):
        entered.set()
        assert release.wait(60)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HostArena, "_make", slow_make)
    ck = Checkpointer(CheckpointConfig(root=str(tmp_path)))
    fut = ck.prewarm(_state(model, opt))
    assert entered.wait(60)
    closer = threading.Thread(target=ck.close)
    closer.start()
    assert not fut.done()
    release.set()
    closer.join(60)
    assert not closer.is_alive() and fut.result(timeout=1) > 0
    assert not [t for t in threading.enumerate() if t.name.startswith("fastckpt-prewarm")]
    with pytest.raises(Exception, match="closed"):
        ck.prewarm(_state(model, opt))
