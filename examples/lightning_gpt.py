"""Train a GPT with Lightning and checkpoint it with fastckpt: what does a checkpoint cost the training loop?

The data is generated locally (a noisy arithmetic-sequence "language"): nothing is downloaded. The model is sized so
that checkpoints matter: 25M parameters, a checkpoint of about 300 MB (the weights and AdamW's two moments), one
every --every steps in its windows; 1.5 minutes on a 2-core machine shared with other jobs, 3.3 beside two more
CPU-bound processes (--width and --layers make it smaller).

    python examples/lightning_gpt.py                          # checkpoints in ./checkpoints/lightning_gpt
    python examples/lightning_gpt.py --resume                 # continue from last.ckpt there, --steps more
    python examples/lightning_gpt.py --root s3://bucket/gpt \\
        --storage-options '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}}'
    python examples/lightning_gpt.py cli fit --config examples/lightning_cli.yaml   # the same through LightningCLI

The cost of a checkpoint is measured as benchmarks/ measure it: the run is cut into windows of --every steps,
a warm-up window (each plugin's first save, not counted), then clean / fastckpt / clean / AsyncCheckpointIO /
clean / ... in one run, so both plugins face the same machine. A checkpointed window saves once (one
ModelCheckpoint save: the newest file and last.ckpt) at its start and waits for the save at its end. A line per
window shows the progress. At the end it prints the figures of every fastckpt checkpoint (blocking ms, waited ms,
staging ms, persist s, MB, MB/s), then per plugin and per checkpoint:

- blocked: how long the checkpoint held the training loop (its save_checkpoint calls, and for fastckpt the
  optimizer steps' wait for its lazy copy), median and total over the windows;
- CPU: the CPU time it took (this process's threads and its child processes: the window's CPU time minus the mean
  of the clean windows on either side);
- wall: the window's wall-clock time minus the mean of its clean neighbours (what the run took longer).

Blocked and CPU time hardly move when other processes share the machine; wall-clock time does (a busy neighbour
can move a window by seconds). So the verdict comes from the first two: which plugin is cheaper and by how much,
with the noise of each figure (two standard errors, from the windows' spread); the wall-clock figures are printed
beside it (--no-compare: fastckpt alone). Training runs on all CPUs but one (--threads), which is left to both
plugins' background threads: with training's threads on every CPU, their spinning made the CPU figures move with
the load too. No figure counts the kernel's writeback of AsyncCheckpointIO's page-cache writes (fastckpt's own
writes, O_DIRECT where the file system allows, are in its threads' time): the CPU figure, if anything, favours
AsyncCheckpointIO. It also draws the step times with the windows shaded, and each figure per plugin on its own
scale, to --plot (default: timeline.png in --root, when --root is a local folder; after --resume,
timeline-from-step-N.png, so the first run's picture stays; needs matplotlib: pip install -e ".[demo]").
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_WINDOWS = 22  # a warm-up, 5 checkpointed windows per plugin between clean ones, a clean one to close


def parse(argv: list[str]) -> argparse.Namespace:
    """The demo's command line (``cli ...`` is LightningCLI's own), ``--steps`` resolved. It needs nothing from
    Lightning, torch or fastckpt, which the file imports only below it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default="checkpoints/lightning_gpt", help="checkpoint folder: a path or s3://...")
    parser.add_argument("--storage-options", default="{}", help="fsspec options as JSON (endpoint, credentials)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from last.ckpt in --root for --steps more (the model's size from there)")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps to train (with --resume: steps to add); default: {DEFAULT_WINDOWS} windows of "
                             "--every steps, five checkpoints per plugin")
    parser.add_argument("--every", type=int, default=3,
                        help="window length in steps: each checkpointed window holds one checkpoint")
    parser.add_argument("--width", type=int, default=512,
                        help="the model's width (attention heads of 64): 512 with 8 --layers is 25M parameters, "
                             "a checkpoint of about 300 MB")
    parser.add_argument("--layers", type=int, default=8, help="the model's transformer blocks")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences of 64 tokens per step")
    parser.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1),
                        help="training's CPU threads (torch.set_num_threads); default: all CPUs but one, which is left "
                             "to the checkpoint threads of both plugins")
    parser.add_argument("--config", default=None, help="a fastckpt YAML file (staging, persist...)")
    parser.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                        help="also measure Lightning's AsyncCheckpointIO, in windows interleaved with fastckpt's "
                             "in the same run (not with --resume)")
    parser.add_argument("--plot", default=None,
                        help="timeline PNG (default: timeline.png in a local --root; after --resume from step N, "
                             "timeline-from-step-N.png there)")
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = DEFAULT_WINDOWS * args.every
    if min(args.every, args.steps, args.width, args.layers, args.batch_size, args.threads) < 1:
        parser.error("--steps, --every, --width, --layers, --batch-size and --threads must be at least 1")
    return args


if __name__ == "__main__" and sys.argv[1:2] != ["cli"]:
    # --help and a wrong argument are answered here, at once, not after the seconds of importing Lightning below
    parse(sys.argv[1:])

import json
import math
import statistics
import tempfile
import time
from typing import NamedTuple

import fsspec
import lightning.pytorch as pl
import psutil
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fastckpt.errors import ConfigError
from fastckpt_lightning import FastCheckpointIO, FastModelCheckpoint
from fastckpt.timeline import (CLEAN, MIN_WINDOWS, Window, WindowCost, median_and_noise, paired_costs, plot_cost,
                                verdict)
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
        # fused: one pass over each tensor per step (the for-loop update took 5x as long on CPU, measured)
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1, fused=True)
        total = max(self.trainer.max_steps, 1)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def cpu_seconds() -> float:
    """CPU time so far of this process (every thread: training's and the checkpoint threads') and of its child
    processes, running (a persister process) or ended."""
    me = psutil.Process()
    total = time.process_time()
    ended = me.cpu_times()
    total += ended.children_user + ended.children_system
    for child in me.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:  # it ended in between: counted with the ended ones once it is reaped
            continue
        total += times.user + times.system
    return total


class StepClock(Callback):
    """Wall and CPU time of every training step, start to start: a step's time includes the checkpoint saved at its
    end."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.cpu: list[float] = []  # cpu_seconds() at each step's start
        self.end: float | None = None
        self.end_cpu: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self.starts.append(time.perf_counter())
        self.cpu.append(cpu_seconds())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        # The last step ends here, before the final ModelCheckpoint save (checkpoint callbacks run last): that
        # last.ckpt is outside every window.
        self.end, self.end_cpu = time.perf_counter(), cpu_seconds()

    def step(self) -> int:
        """The index of the running step in this fit (0 for the first)."""
        return len(self.starts) - 1

    def step_ms(self) -> list[float]:
        bounds = [*self.starts, self.end if self.end is not None else time.perf_counter()]
        return [(b - a) * 1e3 for a, b in zip(bounds, bounds[1:])]

    def step_cpu_ms(self) -> list[float]:
        """CPU milliseconds of each step, start to start, as :meth:`step_ms` (the checkpoint threads' included)."""
        bounds = [*self.cpu, self.end_cpu if self.end_cpu is not None else cpu_seconds()]
        return [(b - a) * 1e3 for a, b in zip(bounds, bounds[1:])]


class Progress(Callback):
    """One line per window once it has ended (its checkpoint waited for): the steps, wall and CPU time, what the
    checkpoint blocked the loop, the loss. Registered after the StepClock, so its step has started."""

    def __init__(self, plan: list[Window], clock: StepClock, io: RoutedIO, offset: int) -> None:
        self.plan, self.clock, self.io, self.offset = plan, clock, io, offset
        self.shown = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        step = self.clock.step()
        while self.shown < len(self.plan) and self.plan[self.shown].first + self.plan[self.shown].steps <= step:
            self.show(trainer, self.clock.starts[step], self.clock.cpu[step])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.clock.end is not None:
            while self.shown < len(self.plan):
                self.show(trainer, self.clock.end, self.clock.end_cpu)

    def show(self, trainer: pl.Trainer, end: float, end_cpu: float) -> None:
        w = self.plan[self.shown]
        self.shown += 1
        wall, cpu = end - self.clock.starts[w.first], end_cpu - self.clock.cpu[w.first]
        blocked = window_blocked(w, self.io)
        loss = trainer.callback_metrics.get("train_loss")
        print(f"window {self.shown:>3}/{len(self.plan)}  {w.kind:<17} steps {self.offset + w.first:>4}-"
              f"{self.offset + w.first + w.steps - 1:<4}  wall {wall:6.2f} s  CPU {cpu:6.2f} s"
              + (f"  blocked {blocked:7.1f} ms" if w.kind != CLEAN else " " * 20)
              + (f"  loss {float(loss):.3f}" if loss is not None else ""), flush=True)


FAST, ASYNC, WARMUP = "fastckpt", "AsyncCheckpointIO", "warm-up"


def window_plan(steps: int, every: int, kinds: list[str]) -> list[Window]:
    """The run cut into windows of ``every`` steps, as benchmarks/ measure: a warm-up window (every plugin's first
    save: threads, plans and allocations, not counted), then clean, kinds[0], clean, kinds[1], clean, ... A trailing
    part shorter than a window is left out."""
    rotation = [kind for plugin in kinds for kind in (CLEAN, plugin)]
    return [Window(WARMUP if i == 0 else rotation[(i - 1) % len(rotation)], i * every, every)
            for i in range(steps // every)]


class Save(NamedTuple):
    """One save_checkpoint call: when, in which step of the fit (and global step), which file, which plugin, and how
    long the call held the training thread."""

    start: float
    step: int
    global_step: int
    name: str
    kind: str
    blocking_ms: float


class RoutedIO(FastCheckpointIO):
    """fastckpt's plugin, except that the files under ``async_folder`` go to Lightning's AsyncCheckpointIO: one run,
    so both plugins save the same model on the same machine, in alternating windows. Records every save."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.async_io: AsyncCheckpointIO | None = None
        self.async_folder: str | None = None
        self.saves: list[Save] = []

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
        self.saves.append(Save(start, self.steps.step(), int(checkpoint["global_step"]), os.path.basename(str(path)),
                               kind, (time.perf_counter() - start) * 1e3))

    def waited_ms(self, global_step: int) -> float:
        """How long optimizer steps waited for fastckpt's lazy copies of the saves at ``global_step``."""
        return sum(s.waited_ms for s in self.stats if s.step == global_step)

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


def window_blocked(window: Window, io: RoutedIO) -> float:
    """How long the checkpoint of ``window`` held the training loop, in ms: its save_checkpoint calls, and for
    fastckpt the optimizer steps' wait for the lazy copy."""
    saves = [s for s in io.saves if window.first <= s.step < window.first + window.steps]
    waited = sum(io.waited_ms(g) for g in {s.global_step for s in saves if s.kind == FAST})
    return sum(s.blocking_ms for s in saves) + waited


def blocked_costs(plan: list[Window], io: RoutedIO, kinds: list[str], clean_step_ms: list[float]) -> list[WindowCost]:
    """Per plugin, the loop time each checkpoint blocked, one value per checkpointed window (the warm-up's first
    saves not counted), as a :class:`WindowCost`: median and noise as for the paired figures."""
    costs = []
    for kind in kinds:
        values = tuple(window_blocked(w, io) for w in plan if w.kind == kind)
        median, noise = math.nan, math.inf
        if values:
            median, se = median_and_noise(values)
            noise = 2 * se if len(values) >= MIN_WINDOWS else math.inf
        costs.append(WindowCost(kind, values, median, noise, statistics.median(clean_step_ms)))
    return costs


class Costs(NamedTuple):
    """Every figure of every plugin: blocked, CPU and wall-clock ms per checkpoint."""

    blocked: list[WindowCost]
    cpu: list[WindowCost]
    wall: list[WindowCost]


def measure(clock: StepClock, io: RoutedIO) -> Costs:
    step_ms = clock.step_ms()
    clean = [step_ms[i] for w in clock.plan if w.kind == CLEAN for i in range(w.first, w.first + w.steps)] or step_ms
    return Costs(blocked_costs(clock.plan, io, clock.kinds, clean),
                 paired_costs(clock.plan, clock.step_cpu_ms(), clock.kinds),
                 paired_costs(clock.plan, step_ms, clock.kinds))


def figure(cost: WindowCost, scale: float = 1.0, digits: int = 0) -> str:
    """``median ± noise`` of ``cost`` (divided by ``scale``), or what is missing."""
    if not cost.extra_ms:
        return "-"
    noise = f"{cost.noise_ms / scale:.{digits}f}" if cost.measured else "?"
    return f"{cost.median_ms / scale:.{digits}f} ± {noise}"


def print_cost(clock: StepClock, costs: Costs, io: RoutedIO) -> None:
    """What a checkpoint cost the training loop, per plugin, with its noise, and the verdict."""
    plan = clock.plan
    every = plan[0].steps if plan else 0
    rotation = " / ".join(w.kind for w in plan[1:5])
    print(f"\nwhat a checkpoint cost: {len(plan)} windows of {every} steps, a {WARMUP} then {rotation} / ...")
    print(f"{'plugin':<18} {'blocked ms':>14} {'total':>8} {'CPU ms':>14} {'wall-clock ms':>16} {'windows':>7} "
          f"{'clean step ms':>13}")
    for blocked, cpu, wall in zip(costs.blocked, costs.cpu, costs.wall):
        print(f"{blocked.name:<18} {figure(blocked):>14} {sum(blocked.extra_ms):>8.0f} {figure(cpu):>14} "
              f"{figure(wall):>16} {len(blocked.extra_ms):>7} {clean_step(wall):>13}")
    print("(per checkpoint: one ModelCheckpoint save, the newest file and last.ckpt, at the start of its window and "
          "waited for at its end; median ± noise over the windows, the noise two standard errors from their spread. "
          "blocked: the time the training loop was held, in the plugin's save_checkpoint calls and, for fastckpt, in "
          "optimizer steps waiting for its lazy copy; total: over all windows. CPU and wall-clock: the window's time "
          "minus the mean of the clean windows on either side; CPU counts every thread and child process)")
    print(f"verdict: {stable_verdict(costs)}")
    if len(costs.wall) > 1:
        print(f"wall clock: {verdict(costs.wall[0], costs.wall[1])}")


def clean_step(cost: WindowCost) -> str:
    """The median clean step time it was compared with, or "-" without a window between clean ones."""
    return "-" if math.isnan(cost.clean_step_ms) else f"{cost.clean_step_ms:.1f}"


def compared(costs: list[WindowCost]) -> tuple[WindowCost, WindowCost, float, float] | None:
    """The cheaper and the dearer of two plugins' figures, the difference and its noise; None when the noise covers
    the difference or too few windows were measured."""
    first, second = costs
    if not (first.measured and second.measured):
        return None
    diff, noise = second.median_ms - first.median_ms, math.hypot(first.noise_ms, second.noise_ms)
    if abs(diff) <= noise:
        return None
    cheaper, dearer = (first, second) if diff > 0 else (second, first)
    return cheaper, dearer, abs(diff), noise


def ratio(cheaper: WindowCost, dearer: WindowCost) -> str:
    """``dearer`` as a multiple of ``cheaper``, when the cheaper's own figure stands clear of zero."""
    return f", {dearer.median_ms / cheaper.median_ms:.1f}x" if cheaper.median_ms > cheaper.noise_ms else ""


def stable_verdict(costs: Costs) -> str:
    """The verdict from the figures a busy machine hardly moves: the loop time blocked and the CPU time, per
    checkpoint. One plugin alone: what its checkpoints cost."""
    if len(costs.blocked) == 1:
        blocked, cpu = costs.blocked[0], costs.cpu[0]
        if not (blocked.measured and cpu.measured):
            return (f"inconclusive: {min(len(blocked.extra_ms), len(cpu.extra_ms))} checkpointed windows between "
                    f"clean ones, {MIN_WINDOWS} are needed to state the noise; train longer (--steps)")
        return (f"{blocked.name}'s checkpoints blocked the training loop {figure(blocked, digits=1)} ms and took "
                f"{figure(cpu)} CPU ms each")
    n = min(len(c.extra_ms) for c in (*costs.blocked, *costs.cpu))
    if n < MIN_WINDOWS:
        return (f"inconclusive: {n} checkpointed windows per plugin between clean ones, {MIN_WINDOWS} are needed to "
                f"state the noise; train longer (--steps)")
    findings: list[tuple[str | None, str]] = []  # (the cheaper plugin, or None within the noise; what was found)
    for (verb, unit, noun), pair in zip(MEASURES, (costs.blocked, costs.cpu)):
        outcome = compared(pair)
        if outcome is None:
            findings.append((None, f"{noun} per checkpoint within the noise ({pair[0].name} {figure(pair[0])}, "
                                   f"{pair[1].name} {figure(pair[1])} ms)"))
            continue
        cheaper, dearer, diff, noise = outcome
        findings.append((cheaper.name, f"{verb} {diff:.0f} ± {noise:.0f} {unit} less per checkpoint "
                                       f"({cheaper.median_ms:.0f} vs {dearer.median_ms:.0f}{ratio(cheaper, dearer)})"))
    names = {name for name, _ in findings if name}
    if not names:
        return "inconclusive: " + " and ".join(text for _, text in findings) + "; train longer (--steps)"
    if len(names) > 1:
        return "neither is cheaper on both counts: " + "; ".join(f"{name} {text}" for name, text in findings)
    (name,) = names
    return (f"{name} is cheaper: it " + " and ".join(text for found, text in findings if found)
            + "".join(f"; {text}" for found, text in findings if not found))


# the stable figures of the verdict: (what the cheaper one did less, the unit, the figure's name)
MEASURES = (("blocked the training loop", "ms", "the loop time blocked"), ("took", "CPU ms", "the CPU time"))


def fit(io: RoutedIO, model: TinyGPT, data: SequenceDataModule, root: str, steps: int, max_steps: int, every: int,
        resume: bool, async_folder: str | None) -> StepClock:
    """Train ``steps`` steps (to global step ``max_steps``), in windows of ``every`` steps."""
    clock = StepClock()
    io.clock(clock)
    kinds = [FAST] if async_folder is None else [FAST, ASYNC]
    plan = window_plan(steps, every, kinds)
    clock.plan, clock.kinds = plan, kinds
    # Both plugins behind the same ModelCheckpoint settings: each checkpoint writes the newest file (the one before
    # it removed) and last.ckpt. A monitored top-k would skip the file when the loss got worse: windows of unequal work.
    same = dict(save_top_k=1, save_last=True)
    callbacks = [clock, Progress(plan, clock, io, max_steps - steps),
                 WindowCheckpoint(FAST, plan, clock, io, final=True, dirpath=root, **same)]
    if async_folder is not None:
        io.compare(async_folder)
        callbacks.append(WindowCheckpoint(ASYNC, plan, clock, io, final=False, dirpath=async_folder, **same))
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps, plugins=[io], callbacks=callbacks,
                         log_every_n_steps=10, enable_model_summary=False, enable_progress_bar=False, logger=False)
    torch.manual_seed(0)
    trainer.fit(model, data, ckpt_path="last" if resume else None)
    return clock


def resumed_state(plugin: FastCheckpointIO, root: str) -> tuple[int, dict]:
    """The step last.ckpt in ``root`` was saved at (``--resume`` trains ``--steps`` more from there) and the model's
    hyperparameters (its size) saved with it."""
    path = f"{root.rstrip('/')}/last.ckpt" if "://" in root else os.path.join(root, "last.ckpt")
    try:
        checkpoint = plugin.load_checkpoint(path)
    except FileNotFoundError as e:
        raise SystemExit(f"error: --resume found no {path}: run the demo without --resume first") from e
    return int(checkpoint["global_step"]), dict(checkpoint.get("hyper_parameters", {}))


def plot(path: str, clock: StepClock, costs: Costs) -> None:
    panels = {"blocked ms per checkpoint": costs.blocked, "CPU ms per checkpoint": costs.cpu,
              "wall-clock ms per checkpoint": costs.wall}
    written = plot_cost(path, clock.starts, clock.step_ms(), clock.plan, panels,
                        title="GPT step times on CPU: clean windows and checkpointed windows, interleaved")
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
    args = parse(argv)
    steps = args.steps
    torch.set_num_threads(args.threads)
    options = json.loads(args.storage_options)
    local = "://" not in args.root
    if not local and options:
        # ModelCheckpoint lists and checks its folder with fsspec defaults: give them the same options.
        fsspec.config.conf.setdefault(args.root.split("://", 1)[0], {}).update(options)
    plugin = RoutedIO(args.config, storage_options=options)
    # heads of about 64 wide: the most that divide the width, at most width // 64
    heads = max(h for h in range(1, max(1, args.width // 64) + 1) if args.width % h == 0)
    hparams = dict(width=args.width, layers=args.layers, heads=heads)
    start = 0
    if args.resume:
        start, saved = resumed_state(plugin, args.root)
        hparams = {k: v for k, v in saved.items() if k in ("vocab", "width", "layers", "heads", "context", "lr")}
        print(f"resuming from step {start} in {args.root}, training to step {start + steps}")
    model = TinyGPT(**hparams)
    compare = args.compare and not args.resume
    parameters = sum(p.numel() for p in model.parameters())
    plan = window_plan(steps, args.every, [FAST, ASYNC] if compare else [FAST])
    print(f"GPT of {parameters / 1e6:.1f}M parameters (width {model.hparams.width}, {model.hparams.layers} layers): "
          f"a checkpoint of about {parameters * 12 / 1e6:.0f} MB (weights and AdamW's two moments); {steps} steps "
          f"in {len(plan)} windows of {args.every}: a {WARMUP}, then {' / '.join(w.kind for w in plan[1:5])} / ...",
          flush=True)
    # AsyncCheckpointIO writes beside a local root, on the same disk as fastckpt (a /tmp in RAM would flatter it)
    beside = os.path.dirname(os.path.abspath(args.root)) if local else None
    if beside:
        os.makedirs(beside, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".async-ckpt-", dir=beside) as folder:
        # the windows count the steps of this fit, from 0, also after --resume
        clock = fit(plugin, model, SequenceDataModule(batch_size=args.batch_size), args.root, steps, start + steps,
                    args.every, args.resume, folder if compare else None)
    print_stats(plugin)
    costs = measure(clock, plugin)
    print_cost(clock, costs, plugin)
    picture = f"timeline-from-step-{start}.png" if args.resume else "timeline.png"
    target = args.plot or (os.path.join(args.root, picture) if local else None)
    if target:
        try:
            plot(target, clock, costs)
        except ConfigError as e:  # matplotlib missing: the figures above stand without the picture
            print(f"no timeline: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
