"""Train a small GPT with Lightning and checkpoint it with fastckpt: what does a checkpoint cost?

The data is generated locally (a noisy arithmetic-sequence "language"): nothing is downloaded.

    python examples/lightning_gpt.py                          # checkpoints in ./checkpoints/lightning_gpt
    python examples/lightning_gpt.py --resume                 # continue from last.ckpt there, --steps more
    python examples/lightning_gpt.py --root s3://bucket/gpt \\
        --storage-options '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}}'
    python examples/lightning_gpt.py cli fit --config examples/lightning_cli.yaml   # the same through LightningCLI

The cost of a checkpoint is measured as benchmarks/ measure it: the run is cut into windows of --every steps,
a warm-up window (each plugin's first save, not counted), then clean / fastckpt / clean / AsyncCheckpointIO /
clean / ... in one run, so both plugins face the same machine. A checkpointed window saves once (one
ModelCheckpoint save: the top-k file and last.ckpt) at its start and waits for the save at its end; its time minus
the mean of the clean windows on either side is one figure. It prints the figures of every fastckpt checkpoint
(blocking ms, waited ms, staging ms, persist s, MB, MB/s), then per plugin the clean step time, the median extra
time per checkpoint with its noise (two standard errors, from the windows' spread), and a verdict: which plugin is
cheaper and by how much, or "inconclusive" when the noise covers the difference (--no-compare: fastckpt alone).
It also draws the step times with the windows shaded, and both plugins' cost per checkpoint on one millisecond
scale, to --plot (default: timeline.png in --root, when --root is a local folder; needs matplotlib:
pip install -e ".[demo]").
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
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fastckpt.errors import ConfigError
from fastckpt_lightning import FastCheckpointIO, FastModelCheckpoint
from fastckpt.timeline import CLEAN, MIN_WINDOWS, Window, WindowCost, paired_costs, plot_cost, verdict
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

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        # The last step ends here, before the final ModelCheckpoint save (checkpoint callbacks run last): that
        # last.ckpt is outside every window.
        self.end = time.perf_counter()

    def step(self) -> int:
        """The index of the running step in this fit (0 for the first)."""
        return len(self.starts) - 1

    def step_ms(self) -> list[float]:
        bounds = [*self.starts, self.end if self.end is not None else time.perf_counter()]
        return [(b - a) * 1e3 for a, b in zip(bounds, bounds[1:])]


FAST, ASYNC, WARMUP = "fastckpt", "AsyncCheckpointIO", "warm-up"


def window_plan(steps: int, every: int, kinds: list[str]) -> list[Window]:
    """The run cut into windows of ``every`` steps, as benchmarks/ measure: a warm-up window (every plugin's first
    save: threads, plans and allocations, not counted), then clean, kinds[0], clean, kinds[1], clean, ... A trailing
    part shorter than a window is left out."""
    rotation = [kind for plugin in kinds for kind in (CLEAN, plugin)]
    return [Window(WARMUP if i == 0 else rotation[(i - 1) % len(rotation)], i * every, every)
            for i in range(steps // every)]


class RoutedIO(FastCheckpointIO):
    """fastckpt's plugin, except that the files under ``async_folder`` go to Lightning's AsyncCheckpointIO: one run,
    so both plugins save the same model on the same machine, in alternating windows. Records every save."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.async_io: AsyncCheckpointIO | None = None
        self.async_folder: str | None = None
        self.saves: list[tuple[float, int, str, str, float]] = []  # start, step index, file name, plugin, blocking ms

    def compare(self, folder: str) -> None:
        self.async_io, self.async_folder = AsyncCheckpointIO(TorchCheckpointIO()), os.path.abspath(folder)

    def clock(self, steps: StepClock) -> None:
        self.steps = steps

    def routed(self, path) -> bool:
        return self.async_folder is not None and os.path.dirname(os.path.abspath(os.fspath(path))) == self.async_folder

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        start = time.perf_counter()
        if self.routed(path):
            self.async_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
        else:
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        kind = ASYNC if self.routed(path) else FAST
        self.saves.append((start, self.steps.step(), os.path.basename(str(path)), kind,
                           (time.perf_counter() - start) * 1e3))

    def remove_checkpoint(self, path) -> None:
        if self.routed(path):
            self.async_io.remove_checkpoint(path)
        else:
            super().remove_checkpoint(path)

    def finish(self, kind: str) -> None:
        """Wait until the plugin's saves are written: the end of its checkpointed window, as in benchmarks/."""
        if kind == FAST:
            self.flush()
        elif self.async_io is not None:
            self.async_io.teardown()  # waits for its writer thread; the next save starts a new one

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self.async_io is not None:
                self.async_io.teardown()


class WindowCheckpoint(FastModelCheckpoint):
    """A ModelCheckpoint that saves once, at the end of the first step of each of its plugin's windows, and waits
    for that save at the end of the window's last step. With ``final=True`` it also saves at the run's last step (last.ckpt, for
    --resume), after the step clock stopped."""

    def __init__(self, kind: str, plan: list[Window], clock: StepClock, io: RoutedIO, final: bool, **kwargs) -> None:
        super().__init__(every_n_train_steps=1, **kwargs)
        self.kind, self.plan, self.steps, self.io, self.final = kind, plan, clock, io, final

    @property
    def state_key(self) -> str:
        return f"WindowCheckpoint[{self.kind}]"  # two of them in one Trainer: their states apart

    def state_dict(self) -> dict:
        # The AsyncCheckpointIO side writes to a temporary folder: nothing of it belongs in the user's checkpoints
        # (a resume without it would warn about a missing callback).
        return super().state_dict() if self.final else {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        step = self.steps.step()
        if self.final and trainer.global_step >= trainer.max_steps:  # the run's end: last.ckpt, for --resume
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        window = next((w for w in self.plan if w.first <= step < w.first + w.steps), None)
        if window is None or window.kind not in (self.kind, WARMUP):
            return
        if step == window.first:
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if step == window.first + window.steps - 1:
            self.io.finish(self.kind)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """No save at an epoch end: it would land in a clean window."""


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


def print_cost(plan: list[Window], costs: list[WindowCost], io: RoutedIO) -> None:
    """What a checkpoint cost the training loop, per plugin, with its noise, and the verdict."""
    every = plan[0].steps if plan else 0
    rotation = " / ".join(w.kind for w in plan[1:5])
    print(f"\nwhat a checkpoint cost the loop: {len(plan)} windows of {every} steps, a {WARMUP} then {rotation} / ...")
    print(f"{'plugin':<18} {'clean step ms':>13} {'extra ms per ckpt':>17} {'noise ms':>9} {'windows':>7} "
          f"{'range ms':>17} {'blocking ms':>11}")
    for cost in costs:
        blocking = [ms for _, step, _, kind, ms in io.saves if kind == cost.name and plan[0].steps <= step]
        spread = (f"{min(cost.extra_ms):.1f} .. {max(cost.extra_ms):.1f}" if cost.extra_ms else "-")
        noise = f"± {cost.noise_ms:.1f}" if cost.measured else "unknown"
        print(f"{cost.name:<18} {cost.clean_step_ms:>13.1f} {cost.median_ms:>17.1f} {noise:>9} "
              f"{len(cost.extra_ms):>7} {spread:>17} {statistics.median(blocking) if blocking else 0.0:>11.1f}")
    print("(a checkpoint: one ModelCheckpoint save, the top-k file and last.ckpt, at the start of its window and waited "
          "for at its end; extra: the window's time minus the mean of the clean windows on either side, median over "
          "windows; noise: two standard errors of that median, from the spread of the windows; blocking: the median "
          "time inside the plugin's save_checkpoint calls)")
    if len(costs) > 1:
        print(f"verdict: {verdict(costs[0], costs[1])}")
    elif costs:
        cost = costs[0]
        if not cost.measured:
            print(f"verdict: inconclusive: {len(cost.extra_ms)} checkpointed windows between clean ones, "
                  f"{MIN_WINDOWS} are needed to state the noise; train longer (--steps)")
        elif abs(cost.median_ms) <= cost.noise_ms:
            print(f"verdict: {cost.name}'s cost is within the noise of zero ({cost.describe()} per checkpoint)")
        else:
            print(f"verdict: {cost.name} adds {cost.describe()} per checkpoint, "
                  f"{100 * cost.median_ms / (every * cost.clean_step_ms):.1f}% of its window")


def fit(io: RoutedIO, root: str, steps: int, max_steps: int, every: int, resume: bool,
        async_folder: str | None) -> StepClock:
    """Train ``steps`` steps (to global step ``max_steps``), in windows of ``every`` steps."""
    clock = StepClock()
    io.clock(clock)
    kinds = [FAST] if async_folder is None else [FAST, ASYNC]
    plan = window_plan(steps, every, kinds)
    # Both plugins behind the same ModelCheckpoint settings: the same files, the same top-k bookkeeping.
    same = dict(save_top_k=2, monitor="train_loss", save_last=True)
    callbacks = [clock, WindowCheckpoint(FAST, plan, clock, io, final=True, dirpath=root, **same)]
    if async_folder is not None:
        io.compare(async_folder)
        callbacks.append(WindowCheckpoint(ASYNC, plan, clock, io, final=False, dirpath=async_folder, **same))
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, plugins=[io], callbacks=callbacks,
                         log_every_n_steps=10, enable_model_summary=False, enable_progress_bar=False, logger=False)
    torch.manual_seed(0)
    trainer.fit(TinyGPT(), SequenceDataModule(), ckpt_path="last" if resume else None)
    clock.plan, clock.kinds = plan, kinds
    return clock


def resumed_step(plugin: FastCheckpointIO, root: str) -> int:
    """The step last.ckpt in ``root`` was saved at (``--resume`` trains ``--steps`` more from there)."""
    path = f"{root.rstrip('/')}/last.ckpt" if "://" in root else os.path.join(root, "last.ckpt")
    try:
        return int(plugin.load_checkpoint(path)["global_step"])
    except FileNotFoundError as e:
        raise SystemExit(f"error: --resume found no {path}: run the demo without --resume first") from e


def plot(path: str, clock: StepClock, costs: list[WindowCost]) -> None:
    written = plot_cost(path, clock.starts, clock.step_ms(), clock.plan, costs,
                        title="TinyGPT step times on CPU: clean windows and checkpointed windows, interleaved")
    print(f"timeline: {written}")


class ResumableCLI(LightningCLI):
    """LightningCLI that neither starts a second run over a first one's checkpoints nor trains nothing in silence.

    Without ``--ckpt_path last``, ``fit`` starts from scratch: over a folder that holds an earlier run's
    ``last.ckpt``, ModelCheckpoint would write ``last-v1.ckpt`` beside it. ``max_steps`` counts from the run's
    start, so a resume with the first run's ``max_steps`` has nothing left to train: it says so.
    """

    def before_fit(self) -> None:
        dirpath = getattr(self.trainer.checkpoint_callback, "dirpath", None)
        if self.config.fit.get("ckpt_path") is None and dirpath and os.path.exists(os.path.join(dirpath, "last.ckpt")):
            raise SystemExit(f"error: {dirpath} holds last.ckpt of an earlier run; continue it with --ckpt_path last "
                             "(and a larger --trainer.max_steps), or remove the folder to start afresh")

    def after_fit(self) -> None:
        plugin = self.trainer.strategy.checkpoint_io
        if not isinstance(plugin, FastCheckpointIO):
            return
        if not plugin.stats:
            print(f"nothing to train: the run is at step {self.trainer.global_step} and --trainer.max_steps is "
                  f"{self.trainer.max_steps}; pass a larger --trainer.max_steps to continue it")
            return
        print_stats(plugin)


def main(argv: list[str]) -> None:
    if argv[:1] == ["cli"]:
        ResumableCLI(TinyGPT, SequenceDataModule, args=argv[1:], save_config_kwargs={"overwrite": True})
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="checkpoints/lightning_gpt", help="checkpoint folder: a path or s3://...")
    parser.add_argument("--storage-options", default="{}", help="fsspec options as JSON (endpoint, credentials)")
    parser.add_argument("--resume", action="store_true", help="continue from last.ckpt in --root for --steps more")
    parser.add_argument("--steps", type=int, default=220, help="steps to train (with --resume: steps to add)")
    parser.add_argument("--every", type=int, default=10,
                        help="window length in steps: each checkpointed window holds one checkpoint")
    parser.add_argument("--config", default=None, help="a fastckpt YAML file (staging, persist...)")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure Lightning's AsyncCheckpointIO, in windows interleaved with fastckpt's in the same run "
                             "(not with --resume)")
    parser.add_argument("--plot", default=None, help="timeline PNG (default: timeline.png in a local --root)")
    args = parser.parse_args(argv)

    if args.every < 1 or args.steps < 1:
        parser.error("--steps and --every must be at least 1")
    options = json.loads(args.storage_options)
    if "://" in args.root and options:
        # ModelCheckpoint lists and checks its folder with fsspec defaults: give them the same options.
        fsspec.config.conf.setdefault(args.root.split("://", 1)[0], {}).update(options)
    plugin = RoutedIO(args.config, storage_options=options)
    steps = args.steps
    if args.resume:
        start = resumed_step(plugin, args.root)
        steps = start + args.steps
        print(f"resuming from step {start} in {args.root}, training to step {steps}")
    compare = args.compare and not args.resume
    with tempfile.TemporaryDirectory(prefix="async-ckpt-") as folder:
        # the windows count the steps of this fit, from 0, also after --resume
        clock = fit(plugin, args.root, args.steps, steps, args.every, args.resume, folder if compare else None)
    print_stats(plugin)
    costs = paired_costs(clock.plan, clock.step_ms(), clock.kinds)
    print_cost(clock.plan, costs, plugin)
    target = args.plot or (os.path.join(args.root, "timeline.png") if "://" not in args.root else None)
    if target:
        try:
            plot(target, clock, costs)
        except ConfigError as e:  # matplotlib missing: the figures above stand without the picture
            print(f"no timeline: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
