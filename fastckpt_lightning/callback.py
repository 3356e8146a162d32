"""The companion callback: it tells the plugin when parameters are about to change and when training is over.

``FastCheckpointIO`` runs its hooks by itself, before any other callback's (so its waits run before any other
callback can touch parameters), without adding it to the user's ``trainer.callbacks`` (``hooks.py``); nobody needs
to add it by hand.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Protocol

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.optim import Optimizer

from fastckpt_lightning.boundaries import user_code, writers
from fastckpt_lightning.preempt import LightningPreemption

log = logging.getLogger(__name__)


class _Plugin(Protocol):
    """What the callback needs from ``FastCheckpointIO`` (a protocol, so the two modules do not import each other)."""

    async_user_hooks: bool
    config: Any

    def attach(self, trainer: pl.Trainer) -> None: ...

    def wait_staged(self, raise_errors: bool = True) -> None: ...

    def flush(self) -> None: ...

    def log_stats(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None: ...

    def deliver_logger_calls(self) -> None: ...


def _at_boundary(hook: str) -> Callable[..., None]:
    """A boundary hook of the companion that only waits where a writer runs (``wait_for_writers``)."""

    def wait(self: "FastCheckpointCallback", trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.wait_for_writers(trainer, pl_module, hook)

    wait.__name__ = wait.__qualname__ = hook
    wait.__doc__ = f"Finish lazy copies before ``{hook}`` if a callback or the module that runs it may write weights."
    return wait


class FastCheckpointCallback(Callback):
    """Waits for lazy copies before each optimizer step, finishes them when training ends, flushes at teardown."""

    def __init__(self, plugin: _Plugin) -> None:
        self._plugin = plugin
        self.preemption = LightningPreemption(plugin.config, plugin.flush)  # preemption.enabled: flush on a signal

    def wait_for_writers(self, trainer: pl.Trainer, pl_module: Optional[pl.LightningModule], hook: str) -> None:
        """At an epoch or phase boundary: finish lazy copies if a callback or the module that runs ``hook`` next may
        write weights there (``boundaries``: SWA, weight averaging, pruning, fine-tuning, user code), so a checkpoint
        saved before it holds the weights of its step; else keep the overlap."""
        users = [] if self._plugin.async_user_hooks else user_code(trainer, pl_module, hook, self)
        if users:
            # The user's code may look at the files saved before this hook (ModelCheckpoint's at the epoch end just
            # before): they are there, complete, and the ones it removed are gone, as in stock Lightning.
            log.debug("fastckpt_lightning: %s of %s is user code: waiting for pending saves", hook, users)
            self._plugin.flush()
            return
        found = writers(trainer, pl_module, hook, self)
        if found:
            log.debug("fastckpt_lightning: %s of %s may write weights: finishing lazy copies first", hook, found)
            self._plugin.wait_staged()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Wire the plugin before ``ModelCheckpoint.setup`` resolves its folder (it runs last), when this callback
        was passed explicitly (``callbacks=[plugin.callback]``)."""
        self._plugin.attach(trainer)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A new fit may have new optimizers: watch them."""
        self._plugin.attach(trainer)
        self.wait_for_writers(trainer, pl_module, "on_train_start")
        self.preemption.start(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """With ``log_stats=True``: the newest finished checkpoint's figures join the user's logged rows."""
        self._plugin.log_stats(trainer, pl_module)
        self.preemption.point()  # between batches: the safe point of a final checkpoint

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Loggers see the checkpoints that landed."""
        self._plugin.deliver_logger_calls()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Loggers see the checkpoints that landed (the last batch of an epoch has no next batch start); pruning
        and user code may write weights next."""
        self.wait_for_writers(trainer, pl_module, "on_train_epoch_end")
        self._plugin.deliver_logger_calls()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Loggers see the checkpoints that landed."""
        self.wait_for_writers(trainer, pl_module, "on_validation_end")
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

    # The other boundaries where a stock callback or user code may write weights (SWA's BatchNorm epoch starts in
    # on_train_epoch_start, fine-tuning unfreezes there, pruning runs at epoch ends): wait only if one runs there.
    on_fit_start = _at_boundary("on_fit_start")
    on_sanity_check_start = _at_boundary("on_sanity_check_start")
    on_sanity_check_end = _at_boundary("on_sanity_check_end")
    on_train_epoch_start = _at_boundary("on_train_epoch_start")
    on_validation_epoch_start = _at_boundary("on_validation_epoch_start")
    on_validation_epoch_end = _at_boundary("on_validation_epoch_end")
    on_fit_end = _at_boundary("on_fit_end")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Finish copies before callbacks like SWA overwrite weights and the strategy moves the model to CPU."""
        self._plugin.wait_staged()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Finish copies; a background error will still be raised by teardown."""
        self._plugin.wait_staged(raise_errors=False)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Make every checkpoint durable (their figures stay in ``plugin.stats``: no logger row outside the user's
        cadence)."""
        try:
            self._plugin.flush()
        finally:
            self.preemption.stop()  # after the flush: a signal caught since the last batch end goes on now
