"""Checkpoint a plain PyTorch training loop with fastckpt, then resume it.

    python examples/plain_pytorch.py                 # trains 60 steps, checkpoints every 10 into ./checkpoints/plain
    python examples/plain_pytorch.py --resume        # continues from the latest committed checkpoint
    python examples/plain_pytorch.py --root s3://bucket/plain --storage-options '{"client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}}'

`python examples/local_s3.py` starts a local S3 server for the last command (it prints what to export).
"""
from __future__ import annotations

import argparse


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--root", default="checkpoints/plain",
                        help="where checkpoints go: a folder, or any fsspec URL such as s3://bucket/plain")
    parser.add_argument("--storage-options", default="{}", metavar="JSON",
                        help="fsspec options for --root as one JSON object (an S3 endpoint_url, keys)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of the whole run")
    parser.add_argument("--every", type=int, default=10,
                        help="save a checkpoint every N steps (and at the last step); the newest 3 are kept")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest committed checkpoint under --root (up to --steps)")
    return parser.parse_args()


if __name__ == "__main__":
    parse_args()  # --help and a wrong argument are answered here, before torch's import below (seconds)

import json
import time

import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.BatchNorm1d(1024), nn.GELU(), nn.Linear(1024, 256))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = CheckpointConfig(root=args.root, storage_options=json.loads(args.storage_options),
                           retention={"keep_last": 3})
    with Checkpointer(cfg) as ckpt:
        ckpt.watch(optimizer)  # step() waits for pending copies; params/optimizer state are copied lazily
        start = 0
        if args.resume and ckpt.latest() is not None:
            state = ckpt.load_into({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 0,
                                    "rng": torch.get_rng_state()})
            optimizer.load_state_dict(state["optim"])
            torch.set_rng_state(state["rng"])
            start = state["step"] + 1
            print(f"resumed from step {state['step']}")
        if start >= args.steps:  # the run is complete: say so instead of training nothing
            print(f"nothing to train: the checkpoint at step {start - 1} ends a {args.steps}-step run; "
                  f"pass a larger --steps (e.g. --steps {args.steps + args.every}) to continue it")
            return
        t0 = time.perf_counter()
        for step in range(start, args.steps):
            x = torch.randn(64, 256)
            loss = (model(x) - x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % args.every == 0 or step == args.steps - 1:
                state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step,
                         "rng": torch.get_rng_state()}
                ckpt.save(state, step=step)
        ckpt.wait()
        print(f"trained to step {args.steps - 1} in {time.perf_counter() - t0:.1f}s, loss {loss.item():.4f}")
        print(f"{'step':>6} {'blocking ms':>12} {'waited ms':>10} {'staging ms':>11} {'persist s':>10} "
              f"{'MB':>8} {'MB/s':>8}")
        for s in ckpt.stats:
            print(f"{s.step:>6} {s.blocking_ms:>12.2f} {s.waited_ms:>10.2f} {s.staging_ms:>11.1f} {s.persist_s:>10.3f} "
                  f"{s.nbytes / 1e6:>8.2f} {s.throughput_mb_s:>8.0f}")
        print("committed:", [i.name for i in ckpt.list()])


if __name__ == "__main__":
    main()
