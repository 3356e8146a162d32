"""``model.load_state_dict`` of other weights (or an optimizer's) right after ModelCheckpoint saved, under the real
Trainer: every file holds stock's values bit for bit (the values of the save, not the loaded ones), with no warning.

The Accelerate pattern (tests/test_accelerate_load_race.py) in Lightning: user code loads other weights into the
module right after a save (in the module's ``on_train_batch_end``, which runs after ModelCheckpoint's, or in a
callback's next ``on_train_batch_start``). ``HeldIO`` holds every save's background copy until the training thread
waits for staging, so without the plugin's ``load_state_dict`` pre-hooks (fastckpt_lightning/loadhooks.py) the copy
provably reads the loaded weights (a retake holding them); with them each copy is released by the load. The
optimizer case loads into preallocated buffers (``KeepsItsBuffers``); torch's own optimizers rebind their state.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from fastckpt import RetakenSnapshotWarning
from fastckpt.engine.once import WARNED
from helpers import KeepsItsBuffers, assert_bit_equal
from lightning_support import HeldIO, ResumableBatches, TinyModule, make_trainer

pytestmark = pytest.mark.timeout(120)

STEPS = 6


def _load_other_weights(module: TinyModule, step: int) -> None:
    """Seeded by the step, so the stock and the plugin's runs load the same values and train on identically."""
    g = torch.Generator().manual_seed(step)
    module.load_state_dict({k: torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
                            for k, v in module.state_dict().items()})


class LoadsAfterTheSave(TinyModule):
    """Loads other weights in its own ``on_train_batch_end``, which Lightning runs after the callbacks' (the save)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        _load_other_weights(self, self.trainer.global_step)


class LoadsOptimizerStateAfterTheSave(TinyModule):
    """Loads other moments into an optimizer that keeps its buffers (writes them in place) after the save."""

    def configure_optimizers(self) -> Any:
        return KeepsItsBuffers(self.parameters(), lr=1e-2)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        optimizer = self.trainer.optimizers[0]
        state = optimizer.state_dict()
        g = torch.Generator().manual_seed(self.trainer.global_step)
        for s in state["state"].values():
            for k in ("exp_avg", "exp_avg_sq"):
                s[k] = torch.rand(s[k].shape, generator=g, dtype=s[k].dtype)
        optimizer.load_state_dict(state)


class LoadsAtTheNextBatch(Callback):
    """Loads other weights at ``on_train_batch_start``: after the previous batch's save, before its step."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step > 0:
            _load_other_weights(pl_module, trainer.global_step)


def _fit(dirpath: str, where: str, plugin: Optional[HeldIO]) -> None:
    modules = {"module.on_train_batch_end": LoadsAfterTheSave, "optimizer.on_train_batch_end":
               LoadsOptimizerStateAfterTheSave}
    module = modules.get(where, TinyModule)()
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1,
                                                 filename="{step}")]
    if where == "callback.on_train_batch_start":
        callbacks.append(LoadsAtTheNextBatch())
    make_trainer(callbacks, plugin, max_steps=STEPS).fit(module, ResumableBatches())


@pytest.mark.parametrize("where", ["module.on_train_batch_end", "callback.on_train_batch_start",
                                   "optimizer.on_train_batch_end"])
def test_load_state_dict_right_after_a_save_keeps_the_saved_values(tmp_path, where) -> None:
    stock, fast = str(tmp_path / "stock"), str(tmp_path / "fast")
    _fit(stock, where, None)
    WARNED.reset()
    plugin = HeldIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(fast, where, plugin)
    assert not [w for w in caught if issubclass(w.category, RetakenSnapshotWarning)]  # no retake
    names = sorted(os.listdir(stock))
    assert len(names) == STEPS and sorted(os.listdir(fast)) == names, (names, os.listdir(fast))
    for name in names:
        theirs = torch.load(os.path.join(stock, name), weights_only=False)
        ours = torch.load(os.path.join(fast, name), weights_only=False)
        assert_bit_equal(ours["state_dict"], theirs["state_dict"], name)
        assert_bit_equal(ours["optimizer_states"], theirs["optimizer_states"], name)
    hook = where.split(".")[1]
    loads = STEPS - 1 if where == "callback.on_train_batch_start" else STEPS
    assert plugin.released_in[:loads] == [hook] * loads, plugin.released_in
