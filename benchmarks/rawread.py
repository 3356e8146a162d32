"""The disk ceiling of a cold load (issue 27): the best of several raw readers of the same files.

On one virtual disk many parallel O_DIRECT requests win; on another one buffered stream with the kernel's
readahead is at least as fast. So the ceiling a cold loader is held to is the best of:

- ``sequential``: one thread, each file opened buffered with ``POSIX_FADV_SEQUENTIAL``, ``readinto`` of
  ``SEQ_PIECE`` bytes at a time (the kernel's readahead keeps the disk busy ahead of the thread);
- ``parallel``: ``THREADS`` threads of buffered ``preadv`` in ``PIECE`` pieces;
- ``direct``: the same with O_DIRECT (page-aligned lengths; the sub-page tail of a file is left out).

Each reads every byte of the files into memory already faulted in (as a model's is: no first-touch cost), with
no checksum, the files' pages dropped from the page cache before every read; the best of ``reps`` is kept per
reader, every run reported.
"""
from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from fastckpt.read.readers import pread_all

from .measure import drop_file_cache

SEQ_PIECE = 16 << 20
PIECE = 8 << 20
THREADS = 8
READERS = ("sequential", "parallel", "direct")


def _sequential(files: list[str], bufs: list[memoryview]) -> None:
    for path, buf in zip(files, bufs):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for at in range(0, len(buf), SEQ_PIECE):
                pread_all(fd, buf[at: at + SEQ_PIECE], at)
        finally:
            os.close(fd)


def _parallel(files: list[str], bufs: list[memoryview], flags: int) -> None:
    fds = [os.open(f, os.O_RDONLY | flags) for f in files]
    pieces = [(k, at) for k, b in enumerate(bufs) for at in range(0, len(b), PIECE)]

    def one(piece: tuple[int, int]) -> None:
        k, at = piece
        pread_all(fds[k], bufs[k][at: at + PIECE], at)

    try:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(one, pieces))
    finally:
        for fd in fds:
            os.close(fd)


def raw_read(files: list[str], reps: int = 3) -> dict[str, Any]:
    """Each reader of ``READERS`` run ``reps`` times, cold, in turns (so that a noisy spell hits them alike):
    ``{"bytes", "reps", "readers": {name: {"runs": [s...], "seconds": best, "GBps"}}, "best": name}``."""
    sizes = [os.path.getsize(f) - os.path.getsize(f) % 4096 for f in files]  # whole pages: O_DIRECT needs them
    maps = [mmap.mmap(-1, max(n, 1)) for n in sizes]
    for m in maps:
        torch.frombuffer(m, dtype=torch.uint8).fill_(0)  # faulted in, as a model's memory is
    bufs = [memoryview(m)[:n] for m, n in zip(maps, sizes)]
    runs: dict[str, Callable[[], None]] = {
        "sequential": lambda: _sequential(files, bufs),
        "parallel": lambda: _parallel(files, bufs, 0),
        "direct": lambda: _parallel(files, bufs, getattr(os, "O_DIRECT", 0)),
    }
    times: dict[str, list[float]] = {name: [] for name in READERS}
    try:
        for _ in range(reps):
            for name in READERS:
                for f in files:
                    drop_file_cache(f)
                t0 = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - t0)
    finally:
        for b in bufs:
            b.release()
        for m in maps:
            m.close()
    total = sum(sizes)
    readers = {name: {"runs": t, "seconds": min(t), "GBps": total / min(t) / 1e9} for name, t in times.items()}
    return {"bytes": total, "reps": reps, "readers": readers, "best": min(readers, key=lambda n: readers[n]["seconds"])}


def shard_files(folder: Path) -> list[str]:
    """The tensor files of the fastckpt checkpoint(s) under ``folder``."""
    return sorted(str(p) for p in Path(folder).rglob("shard-*.safetensors"))
