"""CUDA paths: pinned arena, copy stream, events, overlap with the next forward.

These need a CUDA device; on CPU-only machines (CI here) they skip and say so.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.storage import open_storage
from tests.helpers import GatedStorage, assert_bit_equal, clone_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")


def _setup(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.BatchNorm1d(1024), nn.ReLU(), nn.Linear(1024, 512)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    x = torch.randn(64, 512, device="cuda")
    return model, opt, x


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_pinned_arena_and_copy_stream(tmp_path) -> None:
    model, opt, x = _setup(tmp_path)
    _step(model, opt, x)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        h = ckpt.save({"m": model.state_dict(), "o": opt.state_dict()}, step=1)
        h.wait()
        slot = next(iter(ckpt._arena._slots.values()))[0]
        assert slot.pinned and all(b.is_pinned() for b in slot._buffers.values())
        assert ckpt._copy_stream is not None and ckpt._copy_stream != torch.cuda.current_stream()


def test_cuda_mutation_race_and_batchnorm(tmp_path) -> None:
    model, opt, x = _setup(tmp_path)
    _step(model, opt, x)
    gated = GatedStorage(open_storage(str(tmp_path)))
    with Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=gated) as ckpt:
        ckpt.watch(opt)
        state = {"m": model.state_dict(), "o": opt.state_dict()}
        torch.cuda.synchronize()
        ref = clone_state(state)
        h = ckpt.save(state, step=1)
        for _ in range(3):
            _step(model, opt, x)  # forward changes BN stats; step waits on the copy events
        torch.cuda.synchronize()
        gated.gate.set()
        h.wait()
        assert_bit_equal(ref, ckpt.load())
        loaded = ckpt.load(map_location="cuda")
        assert loaded["m"]["0.weight"].is_cuda


def test_copy_overlaps_forward(tmp_path) -> None:
    """save() returns before the device-to-host copy finishes; the copy runs beside compute."""
    big = nn.Linear(8192, 8192).cuda()  # 256 MiB of parameters
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        h = ckpt.save({"m": big.state_dict()}, step=0)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        y = big(torch.randn(256, 8192, device="cuda"))  # forward queued while the copy runs
        assert h.stats.blocking_ms < 50
        h.wait_staged()
        opt.step() if big.weight.grad is not None else None
        torch.cuda.synchronize()
        h.wait()
        assert torch.isfinite(y).all()


def test_same_layout_moving_from_cpu_to_cuda_replaces_the_idle_slot(tmp_path) -> None:
    """One plan, first staged unpinned (CPU state), then from CUDA: the idle slot is swapped, no hang."""
    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    cfg = CheckpointConfig(root=str(tmp_path), staging={"slots": 1})
    with Checkpointer(cfg) as ckpt:
        ckpt.save({"m": model.state_dict()}, step=0).wait(timeout=60)
        model.cuda()
        ref = clone_state({"m": model.state_dict()})
        ckpt.save({"m": model.state_dict()}, step=1).wait(timeout=60)
        slots = [s for group in ckpt._arena._slots.values() for s in group]
        assert len(slots) == 1 and slots[0].pinned
        assert_bit_equal({"m": {k: v.cpu() for k, v in ref["m"].items()}}, ckpt.load(step=1))
