"""Train a small GPT with Lightning and checkpoint it with fastckpt.

The data is generated locally (a noisy arithmetic-sequence "language"): nothing is downloaded.

    python examples/lightning_gpt.py                          # checkpoints in ./checkpoints/lightning_gpt
    python examples/lightning_gpt.py --resume                 # continue from last.ckpt there
    python examples/lightning_gpt.py --root s3://bucket/gpt \\
        --storage-options '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}}'
    python examples/lightning_gpt.py cli fit --config examples/lightning_cli.yaml   # the same through LightningCLI

At the end it prints the cost of every checkpoint (blocking ms, staging ms, persist s, MB, MB/s).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import fsspec
import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.utils.data import DataLoader, Dataset

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


def print_stats(plugin: FastCheckpointIO) -> None:
    print(f"{'step':>6} {'blocking ms':>12} {'waited ms':>10} {'stall ms':>9} {'staging ms':>11} {'persist s':>10} "
          f"{'MB':>8} {'MB/s':>8}  path")
    for s in plugin.stats:
        print(f"{s.step:>6} {s.blocking_ms:>12.1f} {s.waited_ms:>10.1f} {s.stall_ms:>9.1f} {s.staging_ms:>11.1f} "
              f"{s.persist_s:>10.3f} {s.nbytes / 1e6:>8.2f} {s.throughput_mb_s:>8.1f}  {s.path}")
    totals = summary(plugin.stats)
    if totals:
        print(f"{totals['checkpoints']} checkpoints, {totals['bytes'] / 1e6:.1f} MB written, "
              f"mean stall {totals['mean_stall_ms']:.1f} ms (blocking {totals['mean_blocking_ms']:.1f} ms, "
              f"max {totals['max_blocking_ms']:.1f} ms)")


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
    parser.add_argument("--resume", action="store_true", help="continue from last.ckpt in --root")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    parser.add_argument("--config", default=None, help="a fastckpt YAML file (staging, persist...)")
    args = parser.parse_args(argv)

    options = json.loads(args.storage_options)
    if "://" in args.root and options:
        # ModelCheckpoint lists and checks its folder with fsspec defaults: give them the same options.
        fsspec.config.conf.setdefault(args.root.split("://", 1)[0], {}).update(options)
    plugin = FastCheckpointIO(args.config, storage_options=options)
    checkpoints = FastModelCheckpoint(dirpath=args.root, every_n_train_steps=args.every, save_top_k=2,
                                      monitor="train_loss", save_last=True)
    trainer = pl.Trainer(accelerator="cpu", max_steps=args.steps, plugins=[plugin], callbacks=[checkpoints],
                         log_every_n_steps=10, enable_model_summary=False)
    trainer.fit(TinyGPT(), SequenceDataModule(), ckpt_path="last" if args.resume else None)
    print_stats(plugin)


if __name__ == "__main__":
    main(sys.argv[1:])
