"""Accelerate's own save/load tests, with the race made deterministic: ``save_state()``, then at once
``load_state_dict`` of other values (the model's, or an optimizer's), then ``load_state()``: the saved values, bit
for bit, 20 times in a row.

The background copy is held by a gate that opens at the first of two moments: when the training thread waits for
staging (the ``load_state_dict`` pre-hooks of fastckpt_accelerate/watcher.py), or after the load has written (a
load post-hook). Without the pre-hooks the copy provably reads the loaded values, so the checkpoint is refused
(``on_mutation: raise``) or retaken with them (``retake``); with them the gate is always opened by the wait.
Upstream: Accelerate's tests/test_accelerator.py::test_save_load_model_* and ``_with_hooks_*``.
"""
from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import fastckpt.engine.pipeline as pipeline_mod
import fastckpt_accelerate
from fastckpt.errors import SnapshotMutatedError
from helpers import KeepsItsBuffers
from accelerate_testing import Setup, assert_same, clone, closing, fresh_accelerate, make_accelerator  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(120)

ROUNDS = 20


class CopyGate:
    """Holds the copy thread's lazy copies until ``open(by)``; ``opened_by`` records who opened it each round."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.opened_by: list[str] = []
        self._lock = threading.Lock()

    def open(self, by: str) -> None:
        with self._lock:
            if not self.event.is_set():
                self.opened_by.append(by)
                self.event.set()

    def close(self) -> None:
        self.event.clear()


@pytest.fixture
def gate(monkeypatch) -> Any:
    gate = CopyGate()
    real = pipeline_mod.Pipeline._copy_into  # a shard's copy, whichever way it copies (engine/onepass.py)

    def gated(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread().name.startswith("fastckpt-copy") and not gate.event.wait(timeout=60):
            raise TimeoutError("test gate never opened")  # a failing test must not hang close()
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod.Pipeline, "_copy_into", gated)
    yield gate
    gate.open("teardown")


def _open_on_wait(checkpointing: Any, gate: CopyGate) -> None:
    """The training thread waiting for staging opens the gate (else it would wait for ever on a held copy)."""
    ckpt = checkpointing.checkpointer
    wait_staged = ckpt.wait_staged

    def opening(*args: Any, **kwargs: Any) -> None:
        gate.open("wait_staged")
        wait_staged(*args, **kwargs)

    ckpt.wait_staged = opening


def _randomized(state: dict[str, Any], seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v.clone()
            for k, v in state.items()}


@pytest.mark.parametrize("on_mutation", ["retake", "raise"])
def test_model_load_state_dict_right_after_save_state(tmp_path, closing, gate, on_mutation) -> None:
    acc = make_accelerator(tmp_path)
    checkpointing = fastckpt_accelerate.enable(acc, {"persist": {"fsync": False},
                                                     "staging": {"on_mutation": on_mutation}})
    closing.append(checkpointing)
    setup = Setup(acc)
    model = acc.unwrap_model(setup.model)
    # Runs after every submodule has loaded: too late for the copy, which then reads the loaded values.
    model.register_load_state_dict_post_hook(lambda *_: gate.open("after the load"))
    gate.open("warm-up")
    setup.step()
    acc.save_state()  # the root's Checkpointer exists from the first save on
    checkpointing.wait()
    _open_on_wait(checkpointing, gate)
    for round in range(ROUNDS):
        expected = clone({"model": model.state_dict(), "optimizer": setup.optimizer.state_dict()})
        gate.close()
        path = acc.save_state()
        model.load_state_dict(_randomized(model.state_dict(), round))  # Accelerate's load_random_weights
        assert not torch.equal(model.state_dict()["0.weight"], expected["model"]["0.weight"])
        acc.load_state(path)
        assert_same(expected["model"], model.state_dict(), f"round {round} model")
        assert_same(expected["optimizer"], setup.optimizer.state_dict(), f"round {round} optimizer")
        setup.step()
    assert gate.opened_by == ["warm-up"] + ["wait_staged"] * ROUNDS
    checkpointing.wait()
    assert len(checkpointing.checkpointer.list()) == ROUNDS + 1


@pytest.mark.parametrize("keeps_buffers", [False, True])
def test_optimizer_load_state_dict_right_after_save_state(tmp_path, closing, gate, keeps_buffers) -> None:
    """torch's optimizers rebind their state on load (the saved tensors stay untouched); one that writes its
    buffers in place is a race like the model's, and its pre-hook (on the inner optimizer) waits too."""
    acc = make_accelerator(tmp_path)
    checkpointing = fastckpt_accelerate.enable(acc, {"persist": {"fsync": False}})
    closing.append(checkpointing)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
    optimizer_type = KeepsItsBuffers if keeps_buffers else torch.optim.AdamW
    model, optimizer = acc.prepare(model, optimizer_type(model.parameters(), lr=1e-2))
    inner = optimizer.optimizer
    inner.register_load_state_dict_post_hook(lambda *_: gate.open("after the load"))

    def step() -> None:
        acc.backward(model(torch.randn(8, 16)).square().mean())
        optimizer.step()
        optimizer.zero_grad()

    gate.open("warm-up")
    step()
    acc.save_state()
    checkpointing.wait()
    _open_on_wait(checkpointing, gate)
    for round in range(ROUNDS):
        expected = clone({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
        gate.close()
        path = acc.save_state()
        other = clone(optimizer.state_dict())
        for i, s in other["state"].items():
            other["state"][i] = {**s, **_randomized({k: s[k] for k in ("exp_avg", "exp_avg_sq")}, 1000 + round)}
        optimizer.load_state_dict(other)
        acc.load_state(path)
        assert_same(expected["model"], model.state_dict(), f"round {round} model")
        assert_same(expected["optimizer"], optimizer.state_dict(), f"round {round} optimizer")
        step()
    assert gate.opened_by == ["warm-up"] + ["wait_staged"] * ROUNDS
    checkpointing.wait()


@pytest.mark.parametrize("write", ["nn.init", "data.copy_"])
def test_other_in_place_writes_right_after_save_state_are_refused_loudly(tmp_path, closing, gate, write) -> None:
    """Writes that are no ``load_state_dict`` (``torch.nn.init``, ``p.data.copy_``, which skips the version counter)
    get no wait: with ``on_mutation: raise`` the checkpoint is refused (``SnapshotMutatedError`` at the next
    ``load_state``), never a silently wrong folder, and the previous checkpoint still loads."""
    acc = make_accelerator(tmp_path)
    checkpointing = fastckpt_accelerate.enable(acc, {"persist": {"fsync": False}, "staging": {"on_mutation": "raise"}})
    closing.append(checkpointing)
    setup = Setup(acc)
    model = acc.unwrap_model(setup.model)
    gate.open("warm-up")
    setup.step()
    first = acc.save_state()
    checkpointing.wait()
    expected = clone(model.state_dict())
    gate.close()
    acc.save_state()
    with torch.no_grad():
        if write == "nn.init":
            nn.init.normal_(model[0].weight)
        else:
            model[0].weight.data.copy_(torch.randn(model[0].weight.shape))
    gate.open("after the write")  # the held copy reads the written values
    with pytest.raises(SnapshotMutatedError, match="0.weight"):
        acc.load_state()
    acc.load_state(first)
    assert_same(expected, model.state_dict())
    assert [i.name for i in checkpointing.checkpointer.list()] == ["checkpoint_0"]
