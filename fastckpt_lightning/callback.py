"""The companion callback: it tells the plugin when parameters are about to change and when training is over.

``FastCheckpointIO`` installs it by itself (first in ``trainer.callbacks``, so its waits run before any other
callback can touch parameters); nobody needs to add it by hand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer

if TYPE_CHECKING:
    from fastckpt_lightning.checkpoint_io import FastCheckpointIO


class FastCheckpointCallback(Callback):
    """Waits for lazy copies before each optimizer step, finishes them when training ends, flushes at teardown."""

    def __init__(self, plugin: FastCheckpointIO) -> None:
        self._plugin = plugin
        self.batches_seen = 0
        """Counts training and validation batches; two saves with no batch in between may share weights."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A new fit may have new optimizers: watch them."""
        self._plugin.attach(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Count the batch (its forward pass updates buffers) and log stats of checkpoints that finished."""
        self.batches_seen += 1
        self._plugin.log_stats(trainer)

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        """Count the batch: user code may update buffers in validation too."""
        self.batches_seen += 1

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        """Parameters and optimizer state change next: lazy copies must be complete."""
        # Not torch's step pre-hook: Lightning passes a closure, and that hook fires before training_step.
        self._plugin.wait_staged()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Callbacks that run next may write parameters in place (an EMA swap): lazy copies first."""
        self._plugin.wait_staged()

    on_test_start = on_validation_start
    on_predict_start = on_validation_start

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Finish copies before callbacks like SWA overwrite weights and the strategy moves the model to CPU."""
        self._plugin.wait_staged()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Finish copies; a background error will still be raised by teardown."""
        self._plugin.wait_staged(raise_errors=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Make every checkpoint durable and log its stats while the loggers are still open."""
        try:
            self._plugin.flush()
        finally:
            self._plugin.log_stats(trainer)
