"""The companion callback: it tells the plugin when parameters are about to change and when training is over.

``FastCheckpointIO`` runs its hooks by itself, before any other callback's (so its waits run before any other
callback can touch parameters), without adding it to the user's ``trainer.callbacks`` (``hooks.py``); nobody needs
to add it by hand.
"""

from __future__ import annotations

from typing import Any, Protocol

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer


class _Plugin(Protocol):
    """What the callback needs from ``FastCheckpointIO`` (a protocol, so the two modules do not import each other)."""

    def attach(self, trainer: pl.Trainer) -> None: ...

    def wait_staged(self, raise_errors: bool = True) -> None: ...

    def flush(self) -> None: ...

    def log_stats(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None: ...

    def deliver_logger_calls(self) -> None: ...


class FastCheckpointCallback(Callback):
    """Waits for lazy copies before each optimizer step, finishes them when training ends, flushes at teardown."""

    def __init__(self, plugin: _Plugin) -> None:
        self._plugin = plugin

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Wire the plugin before ``ModelCheckpoint.setup`` resolves its folder (it runs last), when this callback
        was passed explicitly (``callbacks=[plugin.callback]``)."""
        self._plugin.attach(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A new fit may have new optimizers: watch them."""
        self._plugin.attach(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """With ``log_stats=True``: the newest finished checkpoint's figures join the user's logged rows."""
        self._plugin.log_stats(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Loggers see the checkpoints that landed."""
        self._plugin.deliver_logger_calls()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Loggers see the checkpoints that landed (the last batch of an epoch has no next batch start)."""
        self._plugin.deliver_logger_calls()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Loggers see the checkpoints that landed."""
        self._plugin.deliver_logger_calls()

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
        """Make every checkpoint durable (their figures stay in ``plugin.stats``: no logger row outside the user's
        cadence)."""
        self._plugin.flush()
