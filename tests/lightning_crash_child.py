"""The child of ``test_lightning_crash``: a Lightning run that checkpoints a ~100 MB model at every step with
FastCheckpointIO, reporting what it does so that the parent can SIGKILL it at chosen points.

The test runs ``forked`` in a fork of a forkserver that imported Lightning and fastckpt once, reporting
through a pipe; ``python lightning_crash_child.py DIRPATH`` (by hand) prints the same lines on stdout. One line each,
flushed:
``state STEP CRC`` (the CRC-32 of every tensor of ``state_dict`` right after step STEP, what its checkpoint holds),
``begin PATH`` / ``returned PATH`` around ``save_checkpoint``, ``write PATH I`` before the I-th byte range of a file
goes to disk (so that a kill can land inside a write), and ``durable PATH STEP`` once a file has landed.
"""

from __future__ import annotations

import os
import sys
import threading
import zlib
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from fastckpt import Checkpointer, CheckpointConfig, open_storage
from fastckpt_lightning import FastCheckpointIO
from helpers import WrappedStorage

_print_lock = threading.Lock()  # the committer thread reports too


def _to_stdout(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


_report: Callable[[str], None] = _to_stdout  # forked() reports through its pipe instead


def say(line: str) -> None:
    with _print_lock:
        _report(line)


def state_crc(state: dict[str, torch.Tensor]) -> int:
    """One CRC-32 over the bytes of every tensor, in key order."""
    crc = 0
    for key in sorted(state):
        crc = zlib.crc32(state[key].detach().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


class Wide(pl.LightningModule):
    """Eight 1024x1024 layers: 8.4 M parameters, about 100 MB with AdamW's state."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch).square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.randn(256, 1024, generator=torch.Generator().manual_seed(1)),
                                           batch_size=4)


class ReportedParts(Sequence):
    """The byte ranges of one file; says ``write PATH I`` as the storage takes the I-th."""

    def __init__(self, path: str, parts: Sequence[memoryview]) -> None:
        self.path, self.parts = path, parts

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, index: Any) -> Any:
        return self.parts[index]

    def __iter__(self) -> Iterator[memoryview]:
        for index, part in enumerate(self.parts):
            say(f"write {self.path} {index}")
            yield part


class ReportingStorage(WrappedStorage):
    def write_file_atomic(self, path: str, parts: Sequence[memoryview]) -> None:
        self.inner.write_file_atomic(path, ReportedParts(path, parts))


class Reporting(FastCheckpointIO):
    def _create_checkpointer(self, config: CheckpointConfig) -> Checkpointer:
        return Checkpointer(config, storage=ReportingStorage(open_storage(config.root)))

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        say(f"begin {path}")
        super().save_checkpoint(checkpoint, path, storage_options)
        say(f"returned {path}")


class ReportState(Callback):
    """Before ModelCheckpoint (which runs last) saves at this batch end, report the state it will save, and the
    files that have landed since the last report."""

    def __init__(self, plugin: FastCheckpointIO) -> None:
        self.plugin = plugin
        self.reported = 0

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        say(f"state {trainer.global_step} {state_crc(module.state_dict())}")
        for record in self.plugin.stats[self.reported:]:
            say(f"durable {record.path} {record.step}")
        self.reported = len(self.plugin.stats)


def main(dirpath: str) -> None:
    plugin = Reporting()
    checkpoints = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=1, save_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, max_steps=10_000, callbacks=[ReportState(plugin), checkpoints],
                         plugins=[plugin])
    trainer.fit(Wide())


def forked(dirpath: str, conn: Connection) -> None:
    """The test's entry, in a fork of the forkserver: each line goes to ``conn`` as it is said (as a flushed stdout
    line went to a pipe), and the process's own output is discarded (as the script's stderr was)."""
    global _report
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    _report = lambda line: conn.send_bytes(line.encode())  # noqa: E731
    # One intra-op thread: beside CPU-bound neighbours, each op's parallel region waited (spinning) for a second
    # OpenMP thread to be scheduled; the saves' copies and writes run on fastckpt's own threads either way.
    torch.set_num_threads(1)
    main(dirpath)


if __name__ == "__main__":
    main(sys.argv[1])
