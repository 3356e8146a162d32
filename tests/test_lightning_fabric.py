"""FastCheckpointIO under Lightning Fabric: fabric.save / fabric.load (Fabric passes keyword arguments)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from fastckpt_lightning import FastCheckpointIO
from helpers import assert_bit_equal, clone_state
from lightning_support import INPUTS, TARGETS


def _train_step(model: nn.Module, optimizer, fabric: Fabric) -> None:
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(INPUTS), TARGETS)
    fabric.backward(loss)
    optimizer.step()


def _setup(plugin: FastCheckpointIO):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 1))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return fabric, model, optimizer


@pytest.mark.parametrize("lazy", [False, True], ids=["eager-fallback", "watched"])
def test_fabric_save_then_load_restores_the_saved_values(tmp_path, lazy):
    plugin = FastCheckpointIO(persist={"fsync": False})
    fabric, model, optimizer = _setup(plugin)
    if lazy:
        plugin.watch(optimizer)  # step() now waits for pending copies
    _train_step(model, optimizer, fabric)
    path = tmp_path / "fabric.ckpt"
    expected = {"model": clone_state(model.state_dict()), "optimizer": clone_state(optimizer.state_dict())}

    if lazy:
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    else:
        with pytest.warns(UserWarning, match="copied eagerly"):
            fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    for _ in range(2):  # parameters, optimizer state and BatchNorm buffers all change after the save
        _train_step(model, optimizer, fabric)

    state = {"model": model, "optimizer": optimizer}
    remainder = fabric.load(path, state)
    assert remainder == {"step": 1}
    assert_bit_equal(clone_state(model.state_dict()), expected["model"])
    assert_bit_equal(clone_state(optimizer.state_dict()), expected["optimizer"])
    plugin.teardown()


@pytest.mark.parametrize("with_step", [False, True], ids=["optimizer-counter", "step-key"])
def test_fabric_stats_report_the_training_step_of_each_save(tmp_path, with_step):
    plugin = FastCheckpointIO(persist={"fsync": False})
    fabric, model, optimizer = _setup(plugin)
    plugin.watch(optimizer)
    steps = []
    for step in range(1, 21):
        _train_step(model, optimizer, fabric)
        if step in (3, 20):  # was step=1 and step=2: the plugin numbered its saves
            state = {"model": model, "optimizer": optimizer, **({"step": step + 100} if with_step else {})}
            fabric.save(tmp_path / f"s{step}.ckpt", state)
            steps.append(step + 100 if with_step else step)  # AdamW counts its steps in its state
    plugin.teardown()
    assert [s.step for s in plugin.stats] == steps
