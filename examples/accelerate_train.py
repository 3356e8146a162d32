"""Train a small model with Accelerate, checkpoint through fastckpt every few steps, and resume exactly.

The data is generated locally (a fixed random regression problem), so the script runs anywhere:

    python examples/accelerate_train.py --project-dir runs/accel --steps 40 --save-every 5 --stop-after 20
    python examples/accelerate_train.py --project-dir runs/accel --steps 40 --save-every 5 --resume

    # two processes on CPU (DDP over gloo). `accelerate launch --cpu --num_processes 2` starts ONE process in
    # Accelerate 1.15 (its CPU multi-process path needs mpirun); torchrun starts two, and
    # ACCELERATE_USE_CPU=1 makes the Accelerator use gloo on the CPU:
    ACCELERATE_USE_CPU=1 torchrun --standalone --nproc_per_node 2 examples/accelerate_train.py --project-dir runs/ddp --steps 20

    # checkpoints on S3 (any fsspec URL), settings from a fastckpt YAML file:
    python examples/accelerate_train.py --project-dir runs/s3 --config fastckpt.yaml --steps 40

    # or on a local S3 server: `python examples/local_s3.py` prints the `export` line, then
    python examples/accelerate_train.py --project-dir runs/s3 --root s3://fastckpt-demo/accel --steps 20

`--stop-after K` leaves the loop after optimizer step K as an interrupted job would; `--resume` continues
from the newest committed checkpoint. The resumed run ends in exactly the state of an uninterrupted one:
weights, optimizer, scheduler, RNG, dataloader position and `project_configuration.iteration`.
`--dump FILE` writes that final state (one file per process) so that two runs can be compared.
"""

from __future__ import annotations

import argparse
import sys


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--project-dir", required=True, help="Accelerate project dir (default checkpoint root)")
    parser.add_argument("--config", help="fastckpt YAML file (root, storage_options, staging, ...)")
    parser.add_argument("--root", help="checkpoint root, e.g. s3://bucket/run; overrides the config's root")
    parser.add_argument("--storage-options", default="{}", help="JSON fsspec options for --root")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in the whole run")
    parser.add_argument("--save-every", type=int, default=5, help="save_state() every N optimizer steps")
    parser.add_argument("--total-limit", type=int, default=3, help="checkpoints to keep (ProjectConfiguration)")
    parser.add_argument("--accumulate", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--stop-after", type=int, help="leave after this optimizer step (simulated interruption)")
    parser.add_argument("--resume", action="store_true", help="load_state() the newest checkpoint first")
    parser.add_argument("--hidden", type=int, default=64, help="width of the hidden layer of the small model")
    parser.add_argument("--dump", help="write the final state to FILE.rank{i}.pt")
    parser.add_argument("--shared-writes", choices=["auto", "on", "off"], default="auto",
                        help="with several processes, each writes its share of a checkpoint (auto: when it can)")
    return parser.parse_args()


if __name__ == "__main__":
    parse_args()  # --help and a wrong argument are answered here, before torch's and Accelerate's imports (seconds)

import json
import math
import random
from pathlib import Path

import numpy as np
import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastckpt_accelerate


class Progress:
    """Where the loop is; saved with the checkpoint through ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.micro_step = 0  # batches consumed by this process
        self.step = 0  # optimizer steps taken
        self.losses: list[float] = []

    def state_dict(self) -> dict:
        return {"micro_step": self.micro_step, "step": self.step, "losses": list(self.losses)}

    def load_state_dict(self, state: dict) -> None:
        self.micro_step, self.step, self.losses = state["micro_step"], state["step"], list(state["losses"])


def make_data(n: int = 512, features: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)  # same data on every process and every run
    x = torch.randn(n, features, generator=generator)
    w = torch.randn(features, 1, generator=generator)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=generator))


def make_model(features: int, hidden: int) -> nn.Module:
    # Dropout consumes the RNG; BatchNorm has buffers that change in forward (copied eagerly).
    return nn.Sequential(
        nn.Linear(features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 1)
    )


def fastckpt_config(args: argparse.Namespace) -> dict | str | None:
    """The YAML path as is, or a dict when --root overrides it (a missing root means project_dir/checkpoints)."""
    if args.root is None:
        return args.config
    base = yaml.safe_load(Path(args.config).read_text()) if args.config else {}
    return {**(base or {}), "root": args.root, "storage_options": json.loads(args.storage_options)}


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accumulate,
        project_config=ProjectConfiguration(
            project_dir=args.project_dir, automatic_checkpoint_naming=True, total_limit=args.total_limit
        ),
        # One shuffling seed for all processes (their shards must come from one permutation).
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=0),
    )
    shared = {"auto": None, "on": True, "off": False}[args.shared_writes]
    checkpointing = fastckpt_accelerate.enable(accelerator, fastckpt_config(args), shared_writes=shared)
    set_seed(0, device_specific=True)  # per-process RNG streams (dropout); DDP syncs the initial weights

    dataset = make_data()
    model = make_model(dataset.tensors[0].shape[1], args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, 1000) / 1000))
    )
    # Its own generator: creating a DataLoader iterator draws a seed from the generator it is given, or
    # else from the global RNG, which would make a mid-epoch resume draw different dropout masks.
    loader = DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    refuse_to_overwrite(accelerator, checkpointing, args)
    if args.resume:
        path = accelerator.load_state()
        accelerator.print(f"resumed from {path} at step {progress.step} (iteration {accelerator.save_iteration})")

    total_micro_steps = args.steps * args.accumulate
    while progress.micro_step < total_micro_steps:
        epoch, done_in_epoch = divmod(progress.micro_step, len(loader))
        loader.set_epoch(epoch)  # the seedable sampler shuffles by epoch: the same order after a resume
        batches = accelerator.skip_first_batches(loader, done_in_epoch) if done_in_epoch else loader
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            progress.micro_step += 1
            if accelerator.sync_gradients:
                progress.step += 1
                # Registered objects are saved once, from the main process (as in Accelerate): keep them
                # identical on every process, here by averaging the loss over processes.
                progress.losses.append(accelerator.gather(loss.detach()).mean().item())
                if progress.step % args.save_every == 0:
                    accelerator.save_state()  # returns in milliseconds; persists in the background
                if progress.step == args.stop_after:
                    accelerator.print(f"stopping after step {progress.step}; rerun with --resume")
                    return  # no end_training(): the exit hook still commits the pending checkpoint
            if progress.micro_step >= total_micro_steps:
                break

    checkpointing.wait()
    if accelerator.is_main_process:
        blocking = [s.blocking_ms for s in checkpointing.stats]
        persist = [s.persist_s for s in checkpointing.stats]
        print(
            f"final loss {progress.losses[-1]:.5f}; {len(blocking)} saves, "
            f"save() blocked {np.median(blocking):.2f} ms (median), persisted in {np.median(persist):.3f} s (median)"
        )
    # Every process reports (the main one writes the checkpoint folders, as with stock Accelerate).
    written = sum(s.written_bytes for s in checkpointing.stats)
    print(f"process {accelerator.process_index} of {accelerator.num_processes} wrote {written} bytes "
          f"in {len(checkpointing.stats)} saves", flush=True)
    if args.dump:
        dump_final_state(args.dump, accelerator, model, optimizer, scheduler, progress)
    accelerator.end_training()


def refuse_to_overwrite(accelerator: Accelerator, checkpointing, args: argparse.Namespace) -> None:
    """Exit before training when a fresh run would collide with the checkpoints of an earlier one.

    Automatic naming starts again at checkpoint_0, which exists: the first save_state() would raise a
    ConfigError only after training up to it. Every process learns the main process's listing.
    """
    if args.resume:
        return
    names = [info.name for info in checkpointing.list()]  # every process gets the main process's listing
    if names:
        sys.exit(f"error: {checkpointing.root} already holds checkpoints of an earlier run ({names[0]} .. "
                 f"{names[-1]}); pass --resume to continue it, or another --project-dir (or --root) to start afresh")


def dump_final_state(path, accelerator, model, optimizer, scheduler, progress) -> None:
    torch.save(
        {
            "model": accelerator.unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "progress": progress.state_dict(),
            "iteration": accelerator.save_iteration,
            "accelerator_step": accelerator.step,
            "torch_rng": torch.get_rng_state(),
            "numpy_rng": np.random.get_state(),
            "python_rng": random.getstate(),
        },
        f"{path}.rank{accelerator.process_index}.pt",
    )


if __name__ == "__main__":
    main()
