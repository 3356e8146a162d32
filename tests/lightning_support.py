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
from fastckpt_lightning.pointer import DATA_SUFFIX, read_pointer
from helpers import WrappedStorage, clone_state

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


class GatedStorage(WrappedStorage):
    """Holds every data write until ``gate`` opens. With a tiny ``max_host_bytes`` the core streams staging
    through two ring buffers that writers hand back, so a held write also holds the lazy copy."""

    def __init__(self, inner: Any, gate: threading.Event) -> None:
        super().__init__(inner)
        self.gate = gate

    def write_file(self, path: str, parts: Any) -> None:
        if not self.gate.wait(timeout=120):
            raise TimeoutError("test gate never opened")
        self.inner.write_file(path, parts)


class GatedCheckpointer(Checkpointer):
    """Opens the gate the first time anyone waits for staging (the plugin's callback or torch's step hook)."""

    def __init__(self, config: CheckpointConfig, gate: threading.Event, opened_by: list[str]) -> None:
        from fastckpt import open_storage

        super().__init__(config, storage=GatedStorage(open_storage(config.root), gate))
        self._gate = gate
        self._opened_by = opened_by

    def wait_staged(self) -> None:
        if not self._gate.is_set():
            self._opened_by.append(threading.current_thread().name)
            self._gate.set()
        super().wait_staged()


class GatedIO(FastCheckpointIO):
    """The plugin with lazy copies held back until the training thread waits for them."""

    def __init__(self, **kwargs: Any) -> None:
        # Tiny shards and a two-buffer ring: the lazy copy cannot finish while the first writes are held.
        kwargs.setdefault("staging", {"mode": "lazy", "max_host_bytes": 8192})
        kwargs.setdefault("persist", {"chunk_bytes": 4096, "fsync": False})
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.opened_by: list[str] = []

    def _create_checkpointer(self, config: CheckpointConfig) -> Checkpointer:
        return GatedCheckpointer(config, self.gate, self.opened_by)


def pointer_names(dirpath: str) -> set[str]:
    """Names in ``dirpath`` that are fastckpt pointers."""
    return {name for name in os.listdir(dirpath) if read_pointer(os.path.join(dirpath, name)) is not None}


def data_names(dirpath: str) -> set[str]:
    """Core data folders in ``dirpath``."""
    return {name for name in os.listdir(dirpath) if name.endswith(DATA_SUFFIX)}


def referenced_data(dirpath: str) -> set[str]:
    """Data folders named by the pointers in ``dirpath``."""
    names: set[str] = set()
    for name in pointer_names(dirpath):
        pointer = read_pointer(os.path.join(dirpath, name))
        assert pointer is not None
        names.update(pointer.parts)
    return names
