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
