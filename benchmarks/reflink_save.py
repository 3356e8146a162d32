"""The second save of a state whose big part is frozen, on a local root with reflinks (btrfs, XFS reflink=1):
``persist.reflink: auto`` (unchanged shards cloned) against ``off`` (every shard written). Reports the save's
wall time (``save()`` to durable) and the bytes the block device under the root took for it (``/sys/block``).

    python -m benchmarks.reflink_save DIR [--mib 256] [--reps 3]

DIR must be on a file system with reflinks, mounted from a block device (a loop image is fine:
``truncate -s 2G img && mkfs.btrfs img && mount -o loop img DIR``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from fastckpt import CheckpointConfig, Checkpointer

MiB = 1 << 20


def _device_of(path: Path) -> str:
    """The /sys/block name of the device mounted at the longest mount point holding ``path``."""
    real, best, dev = str(path.resolve()), "", ""
    with open("/proc/mounts") as f:
        for line in f:
            src, mnt = line.split()[:2]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, dev = mnt, src
    return os.path.basename(dev)


def _written(dev: str) -> int:
    """Bytes written to ``dev`` so far (sectors written, the 7th field of its stat, are 512 bytes)."""
    return int(Path(f"/sys/block/{dev}/stat").read_text().split()[6]) * 512


def _state(mib: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    frozen = {f"frozen{i}": torch.randn(64 * MiB // 4, generator=g) for i in range(max(1, mib // 64))}
    return {"model": {**frozen, "head": torch.full((MiB // 4,), float(step))}}


def one(root: Path, dev: str, mib: int, reflink: str, chunk_mib: int = 64) -> tuple[float, int]:
    """Seconds and device bytes of the second save (the first one is the clone source)."""
    ck = Checkpointer(CheckpointConfig(root=str(root), persist={"reflink": reflink, "chunk_bytes": chunk_mib * MiB},
                                       staging={"mode": "eager"}))
    try:
        ck.save(_state(mib, 1), step=1)
        ck.wait()
        state = _state(mib, 2)
        os.sync()
        before, t0 = _written(dev), time.perf_counter()
        ck.save(state, step=2)
        ck.wait()
        took = time.perf_counter() - t0
        os.sync()
        return took, _written(dev) - before
    finally:
        ck.close()
        shutil.rmtree(root, ignore_errors=True)


def measure(workdir: Path, mib: int = 256, reps: int = 3, chunk_mib: int = 64) -> dict[str, Any]:
    dev = _device_of(workdir)
    got: dict[str, list[tuple[float, int]]] = {"auto": [], "off": []}
    for r in range(reps):
        for mode in ("auto", "off") if r % 2 == 0 else ("off", "auto"):
            got[mode].append(one(workdir / f"reflink-bench-{mode}", dev, mib, mode, chunk_mib))
    return {"device": dev, "mib": mib, "reps": reps, "chunk_mib": chunk_mib, **{
        k: {"wall_s": statistics.median(x[0] for x in v), "written_mib": statistics.median(x[1] for x in v) / MiB,
            "runs": v} for k, v in got.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.reflink_save", description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk-mib", type=int, default=64,
                    help="persist.chunk_bytes in MiB; above --mib the changed tensor shares the frozen ones' shard")
    args = ap.parse_args()
    res = measure(Path(args.dir), args.mib, args.reps, args.chunk_mib)
    print(res)
    a, o = res["auto"], res["off"]
    print(f"second save of a {args.mib} MiB frozen + 1 MiB changed state ({args.chunk_mib} MiB shards), median of "
          f"{args.reps}: reflink auto "
          f"{a['wall_s']:.3f} s, {a['written_mib']:.1f} MiB written to {res['device']}; off {o['wall_s']:.3f} s, "
          f"{o['written_mib']:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
