"""Tiny deterministic Lightning pieces shared by the ``test_lightning*`` tests."""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from fastckpt import Checkpointer, CheckpointConfig
from fastckpt_lightning import FastCheckpointIO
from helpers import clone_state
from lightning_models import BATCH, BATCHES_PER_EPOCH, INPUTS, TARGETS, ResumableBatches, TinyModule  # noqa: F401


def make_trainer(callbacks: list[Callback], plugin: Optional[FastCheckpointIO] = None, **overrides: Any) -> pl.Trainer:
    """A quiet CPU trainer; ``overrides`` win."""
    options: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        plugins=[plugin] if plugin is not None else None,
    )
    options.update(overrides)
    return pl.Trainer(**options)


def training_state(module: pl.LightningModule) -> dict[str, Any]:
    """Clones of what a checkpoint's weights part holds, right now."""
    trainer = module.trainer
    return {
        "state_dict": clone_state(module.state_dict()),
        "optimizer_states": [clone_state(opt.state_dict()) for opt in trainer.optimizers],
    }


class RecordAfterStep(Callback):
    """Records the training state at every ``on_train_batch_end`` (when ModelCheckpoint saves), by global step."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.by_step[trainer.global_step] = training_state(pl_module)


class GatedCheckpointer(Checkpointer):
    """Holds the background (lazy) copy until anyone waits for staging (the plugin's callback or torch's step hook),
    and records who opened the gate: proof that the copy really overlapped the next step."""

    def __init__(self, config: CheckpointConfig, gate: threading.Event, opened_by: list[str]) -> None:
        super().__init__(config)
        self._gate = gate
        self._opened_by = opened_by
        pipeline = self._pipeline
        copy_shard = pipeline._copy_shard

        def gated(job: Any, shard: Any, *rest: Any) -> None:
            if threading.current_thread().name.startswith("fastckpt-copy") and not gate.wait(timeout=120):
                raise TimeoutError("test gate never opened")
            copy_shard(job, shard, *rest)

        pipeline._copy_shard = gated

    def wait_staged(self, *args: Any, **kwargs: Any) -> None:
        if not self._gate.is_set():
            self._opened_by.append(threading.current_thread().name)
            self._gate.set()
        super().wait_staged(*args, **kwargs)


class GatedIO(FastCheckpointIO):
    """The plugin with lazy copies held back until the training thread waits for them."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("persist", {"fsync": False})
        # The tests' own callbacks save to observe the overlap: opt in to what ModelCheckpoint's saves do.
        kwargs.setdefault("async_user_saves", True)
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.opened_by: list[str] = []

    def _create_checkpointer(self, config: CheckpointConfig) -> Checkpointer:
        return GatedCheckpointer(config, self.gate, self.opened_by)


class HeldCheckpointer(Checkpointer):
    """Holds every save's background copy until the training thread waits for staging (``GatedCheckpointer``'s gate
    opens once; this one closes again at each save), so each copy provably overlaps whatever runs until the next
    wait, and records the hook that was running when a held copy was released."""

    def __init__(self, config: CheckpointConfig, gate: threading.Event, released_in: list[str],
                 current_hook: Any) -> None:
        super().__init__(config)
        self._gate = gate
        self._released_in = released_in
        self._current_hook = current_hook
        pipeline = self._pipeline
        copy_shard = pipeline._copy_shard

        def held(job: Any, shard: Any, *rest: Any) -> None:
            if threading.current_thread().name.startswith("fastckpt-copy") and not gate.wait(timeout=60):
                raise TimeoutError("test gate never opened: nobody waited for staging")
            copy_shard(job, shard, *rest)

        pipeline._copy_shard = held
        # A seal on the training thread (a save waiting for a slot, the logger relay, a load of a pending file)
        # waits for the copies: that is the training thread waiting for staging too, so it opens the gate.
        new_handle = self._saver.new_handle

        def handle_opening_at_its_seal(*args: Any, **kwargs: Any) -> Any:
            handle = new_handle(*args, **kwargs)
            seal = handle.seal

            def opening_seal() -> None:
                if not handle.staged():
                    self._open()
                seal()

            handle.seal = opening_seal
            return handle

        self._saver.new_handle = handle_opening_at_its_seal

    def save_file(self, *args: Any, **kwargs: Any) -> Any:
        self._gate.clear()
        return super().save_file(*args, **kwargs)

    def _open(self) -> None:
        if not self._gate.is_set():
            self._released_in.append(self._current_hook())
            self._gate.set()

    def wait_staged(self, *args: Any, **kwargs: Any) -> None:
        self._open()
        super().wait_staged(*args, **kwargs)

    def wait(self, *args: Any, **kwargs: Any) -> None:
        self._open()
        super().wait(*args, **kwargs)

    def close(self, *args: Any, **kwargs: Any) -> None:
        self._gate.set()
        super().close(*args, **kwargs)


class HeldIO(FastCheckpointIO):
    """The plugin with every lazy copy held back until the training thread waits for it; ``released_in`` lists
    the Lightning hook that was running at each release (``"?"`` outside a hook)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("persist", {"fsync": False})
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.released_in: list[str] = []

    def _current_hook(self) -> str:
        trainer = self._attached_trainer()
        module = trainer.lightning_module if trainer is not None else None
        return getattr(module, "_current_fx_name", None) or "?"

    def _create_checkpointer(self, config: CheckpointConfig) -> Checkpointer:
        return HeldCheckpointer(config, self.gate, self.released_in, self._current_hook)


def ckpt_names(dirpath: str) -> set[str]:
    """The checkpoint files in ``dirpath`` (every other name is a failure: no sidecars, no temporaries)."""
    names = set(os.listdir(dirpath))
    assert all(name.endswith(".ckpt") for name in names), names
    return names


class FlushEachBatch(Callback):
    """Makes every pending checkpoint durable before each batch: their figures are then there by its end."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        plugin = trainer.strategy.checkpoint_io
        plugin.wait_staged()
        plugin.flush()
