"""Tiny deterministic Lightning pieces shared by the ``test_lightning*`` tests."""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from fastckpt import Checkpointer, CheckpointConfig
from fastckpt_lightning import FastCheckpointIO
from helpers import clone_state

BATCH = 4
BATCHES_PER_EPOCH = 4
_GEN = torch.Generator().manual_seed(1234)
INPUTS = torch.randn(BATCH * BATCHES_PER_EPOCH, 16, generator=_GEN)
TARGETS = torch.randn(BATCH * BATCHES_PER_EPOCH, 1, generator=_GEN)


class ResumableBatches:
    """Fixed batches in a fixed order that resume mid-epoch (Lightning saves and restores ``state_dict``)."""

    def __init__(self) -> None:
        self._batches = [(INPUTS[i : i + BATCH], TARGETS[i : i + BATCH]) for i in range(0, len(INPUTS), BATCH)]
        self._start = 0
        self._handed_out = 0

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self):
        start, self._start = self._start, 0
        for index in range(start, len(self._batches)):
            # Lightning asks for the state after the batch trained: count it as handed out before yielding it.
            self._handed_out = index + 1
            yield self._batches[index]

    def state_dict(self) -> dict[str, int]:
        return {"handed_out": self._handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._start = state["handed_out"] % len(self._batches)


class TinyModule(pl.LightningModule):
    """Two linear layers (optionally with BatchNorm), AdamW and a StepLR schedule; deterministic from seed 0."""

    def __init__(self, batchnorm: bool = False, manual: bool = False, width: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        norm: nn.Module = nn.BatchNorm1d(width) if batchnorm else nn.Identity()
        self.net = nn.Sequential(nn.Linear(16, width), norm, nn.Tanh(), nn.Linear(width, 1))
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}


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
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.opened_by: list[str] = []

    def _create_checkpointer(self, config: CheckpointConfig) -> Checkpointer:
        return GatedCheckpointer(config, self.gate, self.opened_by)


def ckpt_names(dirpath: str) -> set[str]:
    """The checkpoint files in ``dirpath`` (every other name is a failure: no sidecars, no temporaries)."""
    names = set(os.listdir(dirpath))
    assert all(name.endswith(".ckpt") for name in names), names
    return names
