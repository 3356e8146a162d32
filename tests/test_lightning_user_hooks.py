"""User code at an epoch boundary sees the checkpoint files saved before it, as with stock Lightning.

Lightning's own ``test_none_monitor_not_alternating`` lists the checkpoint folder in the module's
``on_train_epoch_start`` and expects the file ``ModelCheckpoint`` saved at the previous epoch's end: with the
plugin it was not there yet (the save was still being written). The companion now waits for pending saves, and
for ``ModelCheckpoint``'s removals, at a boundary where user code runs (the module's override, or a callback that
is not Lightning's); Lightning's own callbacks keep the overlap (``test_lightning_stock_callbacks.py``).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, LambdaCallback, ModelCheckpoint

from fastckpt_lightning import FastCheckpointIO
from lightning_support import ResumableBatches, TinyModule, make_trainer

EPOCHS = 4


class BigModule(TinyModule):
    """Wide enough (4 MiB of weights, twice that of AdamW state) that writing a checkpoint outlasts the gap to the
    next epoch's start."""

    def __init__(self) -> None:
        super().__init__(width=1 << 16)


class ListDirModule(BigModule):
    """What the user's module sees at each epoch start: the folder's names and the epoch inside ``model.ckpt``."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self.seen: list[tuple[list[str], int]] = []

    def on_train_epoch_start(self) -> None:
        if self.current_epoch > 0:
            names = sorted(os.listdir(self.folder))
            epoch = torch.load(self.folder / "model.ckpt", weights_only=False)["epoch"] if names else -1
            self.seen.append((names, epoch))


class ListDirCallback(Callback):
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.seen: list[list[str]] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch > 0:
            self.seen.append(sorted(os.listdir(self.folder)))


def _fit(module: pl.LightningModule, folder: Path, callbacks: list[Callback], plugin: Any) -> None:
    checkpoint = ModelCheckpoint(dirpath=folder, monitor=None, save_top_k=1, filename="model")
    trainer = make_trainer([*callbacks, checkpoint], plugin, max_epochs=EPOCHS, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, ResumableBatches())


def test_a_modules_epoch_start_sees_the_file_saved_at_the_epoch_end_before(tmp_path):
    # Lightning's test_none_monitor_not_alternating, with every file's content checked too.
    module = ListDirModule(tmp_path)
    _fit(module, tmp_path, [], FastCheckpointIO(persist={"fsync": False}))
    assert module.seen == [(["model.ckpt"], epoch) for epoch in range(EPOCHS - 1)]


def test_a_user_callbacks_epoch_start_sees_the_files_and_never_the_removed_ones(tmp_path):
    callback = ListDirCallback(tmp_path)
    _fit(BigModule(), tmp_path, [callback], FastCheckpointIO(persist={"fsync": False}))
    assert callback.seen == [["model.ckpt"]] * (EPOCHS - 1)


def test_async_user_hooks_opts_out_and_the_files_still_land(tmp_path):
    # The opt-out only drops the wait for files (the copies are still finished there): fit ends with every file.
    module = ListDirModule(tmp_path)
    _fit(module, tmp_path, [], FastCheckpointIO(persist={"fsync": False}, async_user_hooks=True))
    assert len(module.seen) == EPOCHS - 1
    assert os.listdir(tmp_path) == ["model.ckpt"]
    assert torch.load(tmp_path / "model.ckpt", weights_only=False)["epoch"] == EPOCHS - 1


def _noop(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    return None


class CustomCheckpoint(ModelCheckpoint):
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)


def test_who_counts_as_user_code():
    from fastckpt_lightning.boundaries import user_code

    plugin = FastCheckpointIO()
    trainer = make_trainer([ModelCheckpoint(), EarlyStopping(monitor="x"), CustomCheckpoint(),
                            LambdaCallback(on_train_epoch_start=_noop), ListDirCallback(Path(".")),
                            plugin.callback], plugin)
    # Lightning's callbacks and their unchanged hooks never count; a subclass's override and a lambda do.
    # (Lightning moves checkpoint callbacks to the end of its list: compare as sets.)
    assert set(user_code(trainer, BigModule(), "on_train_epoch_start", plugin.callback)) == {
        "CustomCheckpoint", "LambdaCallback", "ListDirCallback"}
    assert user_code(trainer, ListDirModule(Path(".")), "on_train_epoch_end", plugin.callback) == []
    assert user_code(trainer, ListDirModule(Path(".")), "on_train_epoch_start", plugin.callback)[-1] == \
        "ListDirModule"
