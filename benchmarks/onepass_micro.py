"""``python -m benchmarks.onepass_micro [--mb 512] [--reps 5]``: the single pass against two passes, alone.

Times, on one thread (the copy thread's situation), for a buffer of ``--mb`` MB: one memcpy (``ctypes.memmove``,
what the copy thread does), one CRC32C pass, the two one after the other (today: the copy thread copies, an I/O
worker checksums), and the single pass of ``fastckpt.engine.onepass`` (copy a chunk, checksum it while it is in
cache; the same loop, restated). The median of ``--reps`` for each; prints one line per variant. BENCHMARKS.md, "Where the stall goes".
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time
from typing import Callable

import torch

from fastckpt.format.checksum import crc32c

CHUNK = 1 << 20  # fastckpt.engine.onepass.CHUNK (the harness uses only the public API: its loop is restated here)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    n = a.mb << 20
    src = torch.randn(n // 4)
    mm = mmap.mmap(-1, n)
    dst = torch.frombuffer(mm, dtype=torch.uint8)
    dst.fill_(1)  # first touch is not part of a copy into reused staging buffers
    view = memoryview(dst.numpy())

    def copy() -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)

    def crc() -> None:
        crc32c(view)

    def two_passes() -> None:
        copy()
        crc()

    def one_pass() -> None:
        crc = 0
        for o in range(0, n, CHUNK):
            k = min(CHUNK, n - o)
            ctypes.memmove(dst.data_ptr() + o, src.data_ptr() + o, k)
            crc = crc32c(view[o: o + k], crc)

    variants: dict[str, Callable[[], None]] = {"memcpy": copy, "crc32c": crc, "memcpy then crc32c": two_passes,
                                               f"single pass ({CHUNK >> 10} KiB chunks)": one_pass}
    for name, fn in variants.items():
        times = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        print(f"{name:32s} {med * 1e3:7.1f} ms  ({n / med / 1e9:.1f} GB/s; range {min(times) * 1e3:.0f}.."
              f"{max(times) * 1e3:.0f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
