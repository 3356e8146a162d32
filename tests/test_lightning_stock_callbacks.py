"""Lightning's stock callbacks that write weights outside ``optimizer.step()`` pass with the plugin, as stock.

Each test runs the same fit twice, stock Lightning and with ``HeldIO`` (the plugin with every lazy copy held back
until the training thread waits for it, so each copy overlaps everything up to the next wait: the race is
deterministic), and compares every checkpoint file bit for bit, callback state included (SWA's averaged model,
the weight averaging counters). Stock ``StochasticWeightAveraging`` on a BatchNorm model copies the averaged
weights into the live parameters when its BatchNorm epoch starts; before the boundary waits, ``fit`` failed there
with ``SnapshotMutatedError`` and lost the checkpoint.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    Callback,
    EarlyStopping,
    EMAWeightAveraging,
    LambdaCallback,
    ModelCheckpoint,
    ModelPruning,
    ModelSummary,
    StochasticWeightAveraging,
    Timer,
    WeightAveraging,
)
from torch import nn

from fastckpt_lightning import FastCheckpointIO
from fastckpt_lightning.boundaries import writers
from helpers import assert_bit_equal
from lightning_support import HeldIO, ResumableBatches, TinyModule, make_trainer

EPOCHS = 3
# The hooks that wait for lazy copies whatever runs there (before this item): steps, evaluation, the end.
ALWAYS = {"on_before_optimizer_step", "on_validation_start", "on_train_end", "on_exception"}


class WriterModule(TinyModule):
    """TinyModule with a ``backbone`` (BackboneFinetuning), a validation loop when asked, and an optimizer over the
    trainable parameters only (fine-tuning adds the rest later)."""

    def __init__(self, batchnorm: bool = True) -> None:
        super().__init__(batchnorm=batchnorm)
        self.backbone = self.net[0]

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}


class ShrinkAtEpochStart(WriterModule):
    """User code in the module's own boundary hook: shrinks weights through ``.data`` (no version bump: the
    mutation guard cannot see it, so a lazy copy would silently hold the shrunk values)."""

    def on_train_epoch_start(self) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.data.mul_(0.5)


class ShrinkCallback(Callback):
    """The same write from a user's callback."""

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for p in pl_module.parameters():
            p.data.mul_(0.5)


def _shrink(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    for p in pl_module.parameters():
        p.data.mul_(0.5)


def _fit(dirpath: Path, callbacks: list[Callback], plugin: Optional[FastCheckpointIO], validate: bool,
         module_type: type = WriterModule) -> pl.LightningModule:
    module = module_type()
    checkpoints = [
        ModelCheckpoint(dirpath=dirpath, filename="{epoch}-{step}", save_top_k=-1, every_n_epochs=1),
        # Mid-epoch saves too: their copies are still pending when the epoch ends.
        ModelCheckpoint(dirpath=dirpath, filename="s{step}", save_top_k=-1, every_n_train_steps=3),
    ]
    trainer = make_trainer([*callbacks, *checkpoints], plugin, max_epochs=EPOCHS,
                           limit_val_batches=2 if validate else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about workers and logging; not what is tested
        trainer.fit(module, ResumableBatches(), ResumableBatches() if validate else None)
    return module


def _comparable(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Everything but ModelCheckpoint's state, which names the (different) folder, and Timer's (wall time)."""
    result = dict(checkpoint)
    result["callbacks"] = {key: value for key, value in checkpoint["callbacks"].items()
                           if not key.startswith(("ModelCheckpoint", "Timer"))}
    return result


def _assert_stock(tmp_path: Path, make_callbacks: Callable[[], list[Callback]], validate: bool,
                  module_type: type = WriterModule) -> HeldIO:
    stock_dir, fast_dir = tmp_path / "stock", tmp_path / "fast"
    stock = _fit(stock_dir, make_callbacks(), None, validate, module_type)
    plugin = HeldIO()
    fast = _fit(fast_dir, make_callbacks(), plugin, validate, module_type)

    names = sorted(os.listdir(stock_dir))
    assert sorted(os.listdir(fast_dir)) == names
    assert len(names) >= EPOCHS + 3, names
    for name in names:
        theirs = torch.load(stock_dir / name, weights_only=False)
        ours = torch.load(fast_dir / name, weights_only=False)
        assert_bit_equal(_comparable(ours), _comparable(theirs), name)
    assert_bit_equal(fast.state_dict(), stock.state_dict(), "trained module")
    return plugin


def _boundary_releases(plugin: HeldIO) -> list[str]:
    return [hook for hook in plugin.released_in if hook not in ALWAYS]


# ---- one test per stock callback that writes weights ---------------------------------------------------------


@pytest.mark.parametrize("validate", [False, True], ids=["no-val", "val"])
def test_stochastic_weight_averaging_with_batchnorm(tmp_path, validate):
    # swa_epoch_start=1 of 3 epochs: averaging in epochs 1-2, then SWA's own BatchNorm epoch (a fourth), whose start
    # copies the averaged weights into the live parameters while the epoch-end checkpoint is still being copied.
    plugin = _assert_stock(tmp_path, lambda: [StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=1)], validate)
    assert "on_train_epoch_start" in plugin.released_in


def test_ema_weight_averaging_swaps_around_validation(tmp_path):
    # Swaps the averaged weights in at on_validation_epoch_start and back at its end (through .data), and copies
    # them into the model at on_train_end.
    _assert_stock(tmp_path, lambda: [EMAWeightAveraging(decay=0.9)], validate=True)


def test_weight_averaging_swaps_around_validation(tmp_path):
    _assert_stock(tmp_path, lambda: [WeightAveraging()], validate=True)


def test_model_pruning_with_lottery_ticket_at_epoch_end(tmp_path):
    # Prunes at on_train_epoch_end and rewinds the kept weights to their initial values (.data rebinding).
    plugin = _assert_stock(tmp_path, lambda: [ModelPruning(
        "l1_unstructured", amount=0.3, use_lottery_ticket_hypothesis=True, make_pruning_permanent=False)],
        validate=False)
    assert "on_train_epoch_end" in _boundary_releases(plugin)


def test_model_pruning_at_validation_epoch_end_made_permanent(tmp_path):
    _assert_stock(tmp_path, lambda: [ModelPruning(
        "l1_unstructured", amount=0.3, prune_on_train_epoch_end=False, use_lottery_ticket_hypothesis=True)],
        validate=True)


def test_backbone_finetuning_unfreezes_into_the_optimizer(tmp_path):
    # Frozen at on_fit_start; at epoch 1's on_train_epoch_start the backbone joins the optimizer (a new group).
    plugin = _assert_stock(tmp_path, lambda: [BackboneFinetuning(unfreeze_backbone_at_epoch=1)], validate=False)
    assert "on_train_epoch_start" in _boundary_releases(plugin)


# ---- the epoch boundaries generally: user code there ----------------------------------------------------------


def test_a_modules_own_epoch_hook_writing_through_data_is_never_saved_mid_write(tmp_path):
    # A write the mutation guard cannot see: without the wait the checkpoint silently held the shrunk weights.
    plugin = _assert_stock(tmp_path, lambda: [], validate=False, module_type=ShrinkAtEpochStart)
    assert "on_train_epoch_start" in _boundary_releases(plugin)


@pytest.mark.parametrize("make", [ShrinkCallback, lambda: LambdaCallback(on_train_epoch_start=_shrink)],
                         ids=["callback", "lambda"])
def test_a_user_callback_writing_at_epoch_start(tmp_path, make):
    plugin = _assert_stock(tmp_path, lambda: [make()], validate=False)
    assert "on_train_epoch_start" in _boundary_releases(plugin)


# ---- and nowhere else: no stall per step, none where only readers run -----------------------------------------


def test_read_only_callbacks_keep_the_overlap(tmp_path):
    # ModelCheckpoint, EarlyStopping, ModelSummary and Timer implement boundary hooks but only read: no boundary
    # waits, so every held copy, the epoch-end ones included, is released by the next optimizer step (or at the
    # end), never by an epoch boundary; and the files are stock's.
    plugin = _assert_stock(tmp_path, lambda: [EarlyStopping(monitor="val_loss", patience=100), ModelSummary(),
                                              Timer()], validate=True)
    assert plugin.released_in and _boundary_releases(plugin) == [], plugin.released_in
    assert set(plugin.released_in) <= {"on_before_optimizer_step", "on_validation_start", "on_train_end"}


class CustomCheckpoint(ModelCheckpoint):
    """A subclass that overrides a hook: its code may write, so it counts."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)


def test_who_counts_as_a_writer():
    plugin = FastCheckpointIO()
    lam = LambdaCallback(on_train_epoch_start=_shrink)
    trainer = make_trainer([ModelCheckpoint(), EarlyStopping(monitor="x"), CustomCheckpoint(), lam,
                            StochasticWeightAveraging(swa_lrs=0.1), plugin.callback], plugin)
    module = ShrinkAtEpochStart()
    assert writers(trainer, module, "on_train_epoch_start", plugin.callback) == [
        "LambdaCallback", "StochasticWeightAveraging", "ShrinkAtEpochStart"]
    # SWA's epoch end only resets a loop flag: exempt, as ModelCheckpoint's; the subclass's override is not.
    assert writers(trainer, module, "on_train_epoch_end", plugin.callback) == ["CustomCheckpoint"]
    assert writers(trainer, WriterModule(), "on_validation_end", plugin.callback) == []
