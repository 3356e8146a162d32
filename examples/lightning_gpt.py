"""Train a small GPT with Lightning and checkpoint it with fastckpt: what does a checkpoint cost?

The data is generated locally (a noisy arithmetic-sequence "language"): nothing is downloaded.

    python examples/lightning_gpt.py                          # checkpoints in ./checkpoints/lightning_gpt
    python examples/lightning_gpt.py --resume                 # continue from last.ckpt there, --steps more
    python examples/lightning_gpt.py --root s3://bucket/gpt \\
        --storage-options '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}}'
    python examples/lightning_gpt.py cli fit --config examples/lightning_cli.yaml   # the same through LightningCLI

At the end it prints the cost of every checkpoint (blocking ms, waited ms, staging ms, persist s, MB, MB/s),
the training step time without checkpoints, the stall the checkpoints added (and as a % of training time),
and the same figures for Lightning's own AsyncCheckpointIO on the same run (skip it with --no-compare).
It also draws the timeline (step times with each checkpoint's phases) to --plot (default: timeline.png in
--root, when --root is a local folder; needs matplotlib: pip install -e ".[demo]").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import fsspec
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fastckpt.errors import ConfigError
from fastckpt_lightning import FastCheckpointIO, FastModelCheckpoint
from fastckpt_lightning.stats import summary


class SequenceData(Dataset):
    """Token sequences: each row counts up from a random start with a random stride, with 5% noise tokens."""

    def __init__(self, rows: int = 2048, length: int = 65, vocab: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (rows, 1), generator=g)
        stride = torch.randint(1, 4, (rows, 1), generator=g)
        tokens = (start + stride * torch.arange(length)) % vocab
        noise = torch.rand(rows, length, generator=g) < 0.05
        self.tokens = torch.where(noise, torch.randint(0, vocab, (rows, length), generator=g), tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[index]
        return row[:-1], row[1:]


class SequenceDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 32, rows: int = 2048, vocab: int = 64) -> None:
        super().__init__()
        self.batch_size, self.rows, self.vocab = batch_size, rows, vocab

    def train_dataloader(self) -> DataLoader:
        return DataLoader(SequenceData(self.rows, vocab=self.vocab), batch_size=self.batch_size, shuffle=True)


class TinyGPT(pl.LightningModule):
    """A decoder-only transformer: token + position embeddings, pre-norm blocks, tied output head."""

    def __init__(self, vocab: int = 64, width: int = 128, layers: int = 4, heads: int = 4, context: int = 64,
                 lr: float = 3e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(1, context, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)  # tied with the head: unit-scale logits at the start

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(length)
        hidden = self.blocks(self.embed(tokens) + self.position[:, :length], mask=mask, is_causal=True)
        return self.head(self.norm(hidden))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        loss = nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        total = max(self.trainer.max_steps, 1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class StepClock(Callback):
    """Wall time of every training step, start to start: a step's time includes the checkpoint saved at its end."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.end: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.end = time.perf_counter()

    def step_ms(self) -> list[float]:
        bounds = [*self.starts, self.end if self.end is not None else time.perf_counter()]
        return [(b - a) * 1e3 for a, b in zip(bounds, bounds[1:])]


class SaveClock:
    """Mixed into a CheckpointIO: when each save_checkpoint call started, and on which training step."""

    def clock(self, steps: StepClock) -> None:
        self.steps, self.save_starts = steps, []

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.save_starts.append((time.perf_counter(), len(self.steps.starts) - 1, os.path.basename(str(path))))
        super().save_checkpoint(checkpoint, path, storage_options=storage_options)


class TimedFastIO(SaveClock, FastCheckpointIO):
    pass


class TimedAsyncIO(SaveClock, AsyncCheckpointIO):
    pass


def loop_cost(steps: StepClock, save_starts: list[tuple[float, int, str]]) -> dict[str, float]:
    """The step time without checkpoints (median of the steps that neither saved nor followed a save), and the
    stall: what the steps that saved, and the step after each, took beyond it."""
    times = steps.step_ms()
    touched = {i + d for _, i, _ in save_starts for d in (0, 1) if 0 <= i + d < len(times)}
    clean = [t for i, t in enumerate(times) if i not in touched and i > 0]  # step 0 warms up
    base = statistics.median(clean) if clean else 0.0
    stall = sum(max(times[i] - base, 0.0) for i in touched)
    total = sum(times[1:])
    saves = len({i for _, i, _ in save_starts})
    return {"base_ms": base, "stall_ms": stall, "per_save_ms": stall / max(saves, 1), "saves": saves,
            "pct": 100 * stall / total if total else 0.0}


def print_stats(plugin: FastCheckpointIO) -> None:
    print(f"{'step':>6} {'blocking ms':>12} {'waited ms':>10} {'stall ms':>9} {'staging ms':>11} {'persist s':>10} "
          f"{'MB':>8} {'MB/s':>8}  path")
    for s in plugin.stats:
        print(f"{s.step:>6} {s.blocking_ms:>12.1f} {s.waited_ms:>10.1f} {s.stall_ms:>9.1f} {s.staging_ms:>11.1f} "
              f"{s.persist_s:>10.3f} {s.nbytes / 1e6:>8.2f} {s.throughput_mb_s:>8.1f}  {s.path}")
    # last.ckpt is a second save at the same step as the checkpoint before it: counted apart, not in the mean
    for label, records in (("checkpoints", [s for s in plugin.stats if not is_last(s.path)]),
                           ("last.ckpt saves", [s for s in plugin.stats if is_last(s.path)])):
        totals = summary(records)
        if totals:
            print(f"{totals['checkpoints']} {label}, {totals['bytes'] / 1e6:.1f} MB written, mean stall "
                  f"{totals['mean_stall_ms']:.1f} ms (blocking {totals['mean_blocking_ms']:.1f} ms, max "
                  f"{totals['max_blocking_ms']:.1f} ms), mean persist {totals['mean_persist_s']:.2f} s")


def is_last(path: str) -> bool:
    return os.path.basename(path).startswith("last")


def print_cost(runs: dict[str, dict[str, float]]) -> None:
    """The loop's view: step time without checkpoints, and what the checkpoints added to it."""
    print(f"\n{'checkpoint plugin':<22} {'step ms (no ckpt)':>17} {'stall per ckpt ms':>18} {'stall % of training':>20}")
    for name, cost in runs.items():
        print(f"{name:<22} {cost['base_ms']:>17.1f} {cost['per_save_ms']:>18.1f} {cost['pct']:>19.2f}%")
    print("(stall: what the steps that saved, and the step after each, took beyond the median step that did "
          "neither" + ("; both runs train the same model on the same data)" if len(runs) > 1 else ")"))


def fit(io: SaveClock, root: str, steps: int, every: int, resume: bool, fast: bool) -> StepClock:
    clock = StepClock()
    io.clock(clock)
    kind = FastModelCheckpoint if fast else ModelCheckpoint
    checkpoints = kind(dirpath=root, every_n_train_steps=every, save_top_k=2, monitor="train_loss", save_last=True)
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, plugins=[io], callbacks=[clock, checkpoints],
                         log_every_n_steps=10, enable_model_summary=False, enable_progress_bar=False, logger=False)
    torch.manual_seed(0)
    trainer.fit(TinyGPT(), SequenceDataModule(), ckpt_path="last" if resume else None)
    return clock


def resumed_step(plugin: FastCheckpointIO, root: str) -> int:
    """The step last.ckpt in ``root`` was saved at (``--resume`` trains ``--steps`` more from there)."""
    path = f"{root.rstrip('/')}/last.ckpt" if "://" in root else os.path.join(root, "last.ckpt")
    try:
        return int(plugin.load_checkpoint(path)["global_step"])
    except FileNotFoundError as e:
        raise SystemExit(f"error: --resume found no {path}: run the demo without --resume first") from e


def plot(path: str, clock: StepClock, plugin: TimedFastIO) -> None:
    from fastckpt.timeline import SaveMark, plot_timeline

    stats = plugin.stats  # in save order (one folder: its committer handles saves in order)
    marks = [SaveMark(start, record, f"{record.step} {name}")
             for (start, _, name), record in zip(plugin.save_starts, stats)]
    written = plot_timeline(path, clock.starts, clock.step_ms(), marks,
                            title="fastckpt: TinyGPT step times on CPU, with each checkpoint's phases")
    print(f"timeline: {written}")


def main(argv: list[str]) -> None:
    if argv[:1] == ["cli"]:
        cli = LightningCLI(TinyGPT, SequenceDataModule, args=argv[1:], save_config_kwargs={"overwrite": True})
        plugin = cli.trainer.strategy.checkpoint_io
        if isinstance(plugin, FastCheckpointIO):
            print_stats(plugin)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="checkpoints/lightning_gpt", help="checkpoint folder: a path or s3://...")
    parser.add_argument("--storage-options", default="{}", help="fsspec options as JSON (endpoint, credentials)")
    parser.add_argument("--resume", action="store_true", help="continue from last.ckpt in --root for --steps more")
    parser.add_argument("--steps", type=int, default=120, help="steps to train (with --resume: steps to add)")
    parser.add_argument("--every", type=int, default=30, help="checkpoint every N steps")
    parser.add_argument("--config", default=None, help="a fastckpt YAML file (staging, persist...)")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the same training with Lightning's AsyncCheckpointIO (not with --resume)")
    parser.add_argument("--plot", default=None, help="timeline PNG (default: timeline.png in a local --root)")
    args = parser.parse_args(argv)

    options = json.loads(args.storage_options)
    if "://" in args.root and options:
        # ModelCheckpoint lists and checks its folder with fsspec defaults: give them the same options.
        fsspec.config.conf.setdefault(args.root.split("://", 1)[0], {}).update(options)
    plugin = TimedFastIO(args.config, storage_options=options)
    steps = args.steps
    if args.resume:
        start = resumed_step(plugin, args.root)
        steps = start + args.steps
        print(f"resuming from step {start} in {args.root}, training to step {steps}")
    clock = fit(plugin, args.root, steps, args.every, args.resume, fast=True)
    print_stats(plugin)
    runs = {"fastckpt": loop_cost(clock, plugin.save_starts)}
    if args.compare and not args.resume:
        with tempfile.TemporaryDirectory(prefix="async-ckpt-") as folder:
            async_io = TimedAsyncIO()
            async_clock = fit(async_io, folder, steps, args.every, False, fast=False)
            runs["AsyncCheckpointIO"] = loop_cost(async_clock, async_io.save_starts)
    print_cost(runs)
    target = args.plot or (os.path.join(args.root, "timeline.png") if "://" not in args.root else None)
    if target:
        try:
            plot(target, clock, plugin)
        except ConfigError as e:  # matplotlib missing: the figures above stand without the picture
            print(f"no timeline: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
