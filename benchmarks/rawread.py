"""The disk ceiling of a cold load (issue 27): the best of several raw readers of the same files.

On one virtual disk many parallel O_DIRECT requests win; on another one buffered stream with the kernel's
readahead is at least as fast. So the ceiling a cold loader is held to is the best of:

- ``sequential``: one thread, each file opened buffered with ``POSIX_FADV_SEQUENTIAL``, ``readinto`` of
  ``SEQ_PIECE`` bytes at a time (the kernel's readahead keeps the disk busy ahead of the thread);
- ``parallel``: ``THREADS`` threads of buffered ``preadv`` in ``PIECE`` pieces;
- ``direct``: the same with O_DIRECT (page-aligned lengths; the sub-page tail of a file is left out).

Each reads every byte of the files, with no checksum, the files' pages dropped from the page cache before every
read, into memory already faulted in (a model's, what ``load_into`` fills) or into fresh memory (what a loader
that returns new tensors fills, paying the first touch of every page); the best of ``reps`` is kept per reader,
every run reported.

``offset``: the destination starts that many bytes past a page, as a model's tensors do (CPU tensors sit 64 bytes
past one). O_DIRECT needs the file offset and the memory address aligned alike, so no reader can read such memory
with O_DIRECT directly: ``direct`` then reads each piece into a page-aligned buffer of its thread and copies it
(``ctypes.memmove``, the GIL released). This is the raw ceiling of ``load_into`` into memory it cannot choose; the
aligned one (``offset=0``) is the bound no reader reaches there without a page-aligned model.

Why cold reads run at two speeds on the benchmark VM (a Firecracker guest with a memory balloon that reports free
pages to the host), measured 2026-11-29: it is memory, not the disk. Touching 4 GiB of new private memory, 64 MiB at
a time, took 22-31 ms per 64 MiB for ~75% of the chunks and 179-203 ms for the rest; one buffered stream over the
0.63 GB of shards read each 126 MB file in ~90 ms or in 240-470 ms, with the same 50 disk requests of ~2.6 MB, the same
page allocations and faults (/proc/vmstat) and no steal time, but 4-5x the kernel CPU time (60-70 against 240-440 ms):
pages the host has taken back cost a host fault at their first touch. A reader that needs fewer new pages (O_DIRECT:
no page cache) is steadier, not always faster; torch.load's fast runs are the runs whose new pages were cheap.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
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
# The destinations are private memory, as a model's tensors, torch.load's and fastckpt load()'s are (aligned_buffer):
# shared anonymous memory (``mmap.mmap(-1, n)`` alone) costs ~20% more to fault in on the benchmark VM.
_PRIVATE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
# The ceiling's kinds of memory (benchmarks/restore_cold.py holds each loader to one): the shard files into faulted-in
# page-aligned memory, into faulted-in memory 64 bytes past a page (where a model's tensors lie, load_into's
# destination), into fresh memory (load()'s new tensors), and the torch file into fresh memory (torch.load's).
RAW_KINDS = {"aligned": ("fc", False, 0), "unaligned": ("fc", False, 64), "fresh": ("fc", True, 0),
             "torch_file": ("torch.pt", True, 0)}


def _sequential(files: list[str], bufs: list[memoryview]) -> None:
    for path, buf in zip(files, bufs):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for at in range(0, len(buf), SEQ_PIECE):
                pread_all(fd, buf[at: at + SEQ_PIECE], at)
        finally:
            os.close(fd)


def _in_pieces(files: list[str], bufs: list[memoryview], flags: int,
               read: Callable[[int, memoryview, int], None]) -> None:
    """``read(fd, destination, file offset)`` of every ``PIECE`` of every file, on ``THREADS`` threads."""
    fds = [os.open(f, os.O_RDONLY | flags) for f in files]
    pieces = [(k, at) for k, b in enumerate(bufs) for at in range(0, len(b), PIECE)]
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(lambda piece: read(fds[piece[0]], bufs[piece[0]][piece[1]: piece[1] + PIECE], piece[1]),
                          pieces))
    finally:
        for fd in fds:
            os.close(fd)


def _parallel(files: list[str], bufs: list[memoryview], flags: int) -> None:
    _in_pieces(files, bufs, flags, pread_all)


def _bounced(files: list[str], bufs: list[memoryview]) -> None:
    """O_DIRECT into a page-aligned buffer per thread, then a copy into the (unaligned) destination."""
    local = threading.local()

    def read(fd: int, dst: memoryview, at: int) -> None:
        if not hasattr(local, "buf"):
            local.map = mmap.mmap(-1, PIECE)  # page-aligned; unmapped when the thread's locals go
            local.buf = memoryview(local.map)
            local.addr = ctypes.addressof(ctypes.c_char.from_buffer(local.map))
        pread_all(fd, local.buf[:-(-len(dst) // 4096) * 4096], at)  # whole pages: the file's are (raw_read)
        ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(dst)), local.addr, len(dst))

    _in_pieces(files, bufs, getattr(os, "O_DIRECT", 0), read)


def raw_read(files: list[str], reps: int = 3, fresh: bool = False, offset: int = 0,
             readers: tuple[str, ...] = READERS) -> dict[str, Any]:
    """Each of ``readers`` run ``reps`` times, cold, in turns (so that a noisy spell hits them alike):
    ``{"bytes", "reps", "fresh", "readers": {name: {"runs": [s...], "seconds": best, "GBps"}}, "best": name}``.
    ``fresh``: into newly mapped memory, faulted in by the reads themselves (what a loader that returns new tensors
    must do, ``load()`` and torch.load); else into memory faulted in before the clock starts (``load_into``'s model).
    ``offset``: each destination that many bytes past a page (see the module's docstring)."""
    sizes = [os.path.getsize(f) - os.path.getsize(f) % 4096 for f in files]  # whole pages: O_DIRECT needs them
    times: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(reps):
        for name in readers:
            maps = [mmap.mmap(-1, max(n + offset, 1), flags=_PRIVATE) for n in sizes]
            if not fresh:
                for m in maps:
                    torch.frombuffer(m, dtype=torch.uint8).fill_(0)  # faulted in, as a model's memory is
            bufs = [memoryview(m)[offset: offset + n] for m, n in zip(maps, sizes)]
            try:
                for f in files:
                    drop_file_cache(f)
                t0 = time.perf_counter()
                _run(name, files, bufs, bounce=offset % 4096 != 0)
                times[name].append(time.perf_counter() - t0)
            finally:
                for b in bufs:
                    b.release()
                for m in maps:
                    m.close()
    total = sum(sizes)
    readers = {name: {"runs": t, "seconds": min(t), "GBps": total / min(t) / 1e9} for name, t in times.items()}
    return {"bytes": total, "reps": reps, "fresh": fresh, "offset": offset, "readers": readers,
            "best": min(readers, key=lambda n: readers[n]["seconds"])}


def _run(name: str, files: list[str], bufs: list[memoryview], bounce: bool = False) -> None:
    if name == "sequential":
        _sequential(files, bufs)
    elif name == "direct" and bounce:
        _bounced(files, bufs)
    else:
        _parallel(files, bufs, getattr(os, "O_DIRECT", 0) if name == "direct" else 0)


def shard_files(folder: Path) -> list[str]:
    """The tensor files of the fastckpt checkpoint(s) under ``folder``."""
    return sorted(str(p) for p in Path(folder).rglob("shard-*.safetensors"))
