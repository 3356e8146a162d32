"""Why the first checkpoint on a GPU stalls training: page-locking fresh host buffers from another thread.

``python -m benchmarks.gpu_pinprobe [--gb 2] [--out DIR]``. On an H200 (2026-11-26, gpu_bench run 4) the first
checkpoint of 1.96 GB stalled the training thread 1.2 s although its buffers were page-locked on the copy thread
(``waited_ms`` only 179): something in ``cudaHostRegister`` of fresh pages blocks the training thread's own CUDA
calls. This probe measures, for fresh ``mmap`` buffers of ``--gb`` GB page-locked on a second thread in 128 MiB
pieces (fastckpt's default shard size), how long a loop of tiny kernels on the main thread is held up, in three
ways: registering the fresh pages as they are; faulting them in first (``madvise(MADV_POPULATE_WRITE)`` through
ctypes, which releases the GIL) and then registering; and faulting them in alone (no CUDA call). The answer decides
the fix: if faulting in first removes the stall, do it before every registration. Writes ``pinprobe.json``.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import threading
import time
from pathlib import Path
from typing import Any

import torch

MADV_POPULATE_WRITE = 23  # Linux 5.14
PIECE = 128 << 20


def _populate(mm: mmap.mmap) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    rc = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(len(mm)), MADV_POPULATE_WRITE)
    return 0 if rc == 0 else ctypes.get_errno()


def _trial(nbytes: int, how: str) -> dict[str, Any]:
    pieces = [mmap.mmap(-1, PIECE) for _ in range(max(1, nbytes // PIECE))]
    bufs = [torch.frombuffer(m, dtype=torch.uint8) for m in pieces]
    x = torch.ones(1, device="cuda")
    done = threading.Event()
    bg: dict[str, Any] = {}

    def background() -> None:
        t0 = time.perf_counter()
        errs = []
        for m, b in zip(pieces, bufs):
            if how in ("populate+register", "populate"):
                errs.append(_populate(m))
            if how in ("register", "populate+register"):
                errs.append(int(torch.cuda.cudart().cudaHostRegister(b.data_ptr(), PIECE, 1)))
        bg.update(seconds=time.perf_counter() - t0, errors=sorted(set(errs)))
        done.set()

    torch.cuda.synchronize()
    gaps = []
    th = threading.Thread(target=background, name="pinprobe")
    th.start()
    last = time.perf_counter()
    while not done.is_set():  # the training thread: tiny kernels, each waited for
        x.add_(1)
        torch.cuda.synchronize()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    th.join()
    if how != "populate":
        for b in bufs:
            torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
    bufs.clear()  # the exports of the mappings go before they close
    for m in pieces:
        m.close()
    gaps.sort()
    return {"how": how, "gb": nbytes / 1e9, "background_s": bg["seconds"], "errors": bg["errors"],
            "kernels": len(gaps), "longest_gap_ms": gaps[-1] * 1e3 if gaps else None,
            "gaps_over_10ms_total_ms": sum(g for g in gaps if g > 0.01) * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_pinprobe: no CUDA device, nothing measured")
        return 0
    torch.cuda.init()
    nbytes = int(a.gb * 1e9) // PIECE * PIECE
    results = [_trial(nbytes, how) for how in ("register", "populate+register", "populate", "register")]
    for r in results:
        print(json.dumps(r))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "pinprobe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
