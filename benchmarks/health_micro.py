"""``python -m benchmarks.health_micro [--mb 256] [--reps 3]``: CPU seconds per GB of an I/O worker's health + CRC.

On one background thread (an I/O worker's situation), for one staged tensor of ``--mb`` MB per dtype (float32,
bfloat16): ``before``, the separate passes fastckpt ran until issue 27 (restated here: aminmax and float32 group
norms over the whole tensor, torch's intra-op threads free to fan out, then a CRC32C pass), against ``after``,
``fastckpt.format.healthpass.tensor_pass`` (one blocked pass, serial reductions). Prints, per run, the process's
CPU seconds per GB (every thread: intra-op helpers included) and the wall seconds per GB, and the load average.
BENCHMARKS.md, "Health statistics cost".
"""
from __future__ import annotations

import argparse
import math
import os
import threading
import time
from typing import Callable

import torch

from fastckpt.format.checksum import crc32c
from fastckpt.format.healthpass import tensor_pass

_CHUNK = 1 << 22  # the former per-call chunk of values
_GROUP = 512


def before(raw: torch.Tensor, dtype: torch.dtype) -> None:
    """The former passes (format/health.py until issue 27), finite data: aminmax, group norms, then the CRC."""
    values = raw.view(dtype)
    squares = 0.0
    for start in range(0, values.numel(), _CHUNK):
        chunk = values[start:start + _CHUNK]
        lo, hi = torch.aminmax(chunk)
        assert math.isfinite(float(lo)) and math.isfinite(float(hi))
        n = chunk.numel() - chunk.numel() % _GROUP
        norms = torch.linalg.vector_norm(chunk[:n].view(-1, _GROUP), dim=1, dtype=torch.float32)
        squares += float(norms.to(torch.float64).square().sum())
    crc32c(memoryview(raw.numpy()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    rows: list[str] = []

    def run() -> None:
        for dtype in (torch.float32, torch.bfloat16):
            raw = torch.randn((a.mb << 20) // torch.empty(0, dtype=dtype).element_size()).to(dtype).view(torch.uint8)
            variants: dict[str, Callable[[], object]] = {
                "before": lambda: before(raw, dtype), "after": lambda: tensor_pass(raw, dtype, crc=True)}
            got: dict[str, list[str]] = {k: [] for k in variants}
            for _ in range(a.reps):  # interleaved: the shared machine's load hits both alike
                for name, f in variants.items():
                    c0, w0 = time.process_time(), time.perf_counter()
                    f()
                    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                    got[name].append(f"{cpu / (raw.numel() / 1e9):.3f}/{wall / (raw.numel() / 1e9):.3f}")
            for name, runs in got.items():
                rows.append(f"{str(dtype):15} {name:6} CPU/wall s per GB: {'  '.join(runs)}")

    t = threading.Thread(target=run, name="fastckpt-io-bench")
    t.start()
    t.join()
    print(f"load average {os.getloadavg()[0]:.1f}; torch threads {torch.get_num_threads()}")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
