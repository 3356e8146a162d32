"""Flush on preemption under Lightning: the core's ``Preemption``, installed over Lightning's own signal handlers.

Lightning's ``_SignalConnector`` installs its SIGTERM handler (and, with SLURM auto-requeue, SIGUSR1's) when a fit
starts; ours is installed after it, at ``on_train_start``, so the signal reaches us first and Lightning's handler is
the one we chain to once the final checkpoint is durable: Lightning then stops the fit (SIGTERM) or requeues the
SLURM job, as it would have. The safe point is ``on_train_batch_end`` (a batch is finished; Lightning's own
``ModelCheckpoint`` saves there too); the final checkpoint is ``trainer.save_checkpoint`` of
``preempted-step=N.ckpt`` in the ModelCheckpoint folder (else ``default_root_dir``), then the plugin's flush.
"""
from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable, Optional

import lightning.pytorch as pl

from fastckpt import CheckpointConfig, Preemption

log = logging.getLogger(__name__)

__all__ = ["LightningPreemption", "preempted_name"]


def preempted_name(global_step: int) -> str:
    """The file name of the final checkpoint taken at a preemption."""
    return f"preempted-step={global_step}.ckpt"


class LightningPreemption:
    """One fit's preemption handling; inert unless ``preemption.enabled``."""

    def __init__(self, config: CheckpointConfig, flush: Callable[[], None]) -> None:
        self._options = config.preemption
        self._flush = flush
        self._trainer: Optional[Callable[[], Optional[pl.Trainer]]] = None
        self.preemption: Optional[Preemption] = None
        self.path: Optional[str] = None  # the final checkpoint's file, once taken

    def start(self, trainer: pl.Trainer) -> None:
        """At ``on_train_start``: Lightning's handlers are installed by now; ours goes over them."""
        if not self._options.enabled or self.preemption is not None:
            return
        self._trainer = weakref.ref(trainer)
        self.preemption = Preemption(self._options)
        self.preemption.on_preempt_run(self._final)

    def point(self) -> None:
        """At a batch end: take the final checkpoint if a preemption was recorded."""
        if self.preemption is not None:
            self.preemption.point()

    def stop(self) -> None:
        """At teardown, after the plugin's flush: hand on every signal still held (one that came after the last
        batch end gets no final checkpoint: Lightning has torn its strategy down by now) and restore the handler
        we replaced where ours is still installed (Lightning restored its own before the teardown hooks)."""
        if self.preemption is not None:
            self.preemption.close()
            self.preemption = None

    def _final(self, timeout: float) -> None:
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None:
            return
        callback: Any = trainer.checkpoint_callback
        folder = getattr(callback, "dirpath", None) or trainer.default_root_dir
        self.path = os.path.join(folder, preempted_name(trainer.global_step))
        trainer.save_checkpoint(self.path)
        # unbounded: the plugin's flush has no timeout; the scheduler's SIGKILL bounds it (docs/lightning.md)
        self._flush()
