"""Parallel, verified reads of checkpoint byte ranges: the engine under every fast load.

A load is a list of ``Piece``s: a byte range of one file and the memory it lands in (a
tensor's own storage for ``load_into``, a file buffer for ``load``). Pieces are read on a
few threads (``fastckpt-read-N``), each no larger than ``PIECE_BYTES`` (local files:
``LOCAL_PIECE_BYTES``) so that one big
tensor is read by several threads at once and, remotely, by several ranged GETs. The
CRC32C of each piece is taken by the thread that read it, right after it arrived (a buffered local piece in
``LOCAL_CRC_STEP`` steps, each checksummed while still in the CPU cache; the
crc32c module releases the GIL; ``sequential``: by a checker thread behind the one reading thread), and a range's
checksum is combined from its pieces' (``fastckpt.format.checksum.combine``) instead of a second pass over the data.

Local files are read with ``os.preadv`` on one descriptor per file (thread-safe, no seek), in
``LOCAL_PIECE_BYTES`` pieces on at least ``READS_IN_FLIGHT`` threads: the threads mostly wait on the
disk, and the virtual disk of the benchmark VM delivers ~2.5 GB/s only with several requests queued
(one buffered stream: ~1.5-1.9 GB/s). A ``Range`` marked ``direct`` (page-aligned file offset and memory:
a whole shard read into a fresh buffer by ``load()``) is read with O_DIRECT, which skips the page cache
and its copy to user memory; its sub-page tail is read buffered, and a filesystem that
refuses O_DIRECT (tmpfs) is read buffered. Plain buffered reads serve ranges that land in a tensor's own
storage (``load_into``: neither side is page-aligned). Reading through a reused aligned buffer per
thread and copying was measured slower (1.48 GB ``load_into``: cold 1.98 s against 1.15-1.63 s buffered), and again
on 2026-11-28 on a disk where raw O_DIRECT was the fastest reader: O_DIRECT into an 8 MiB page-aligned bounce buffer
per thread, then ``ctypes.memmove`` (GIL released) and the CRC, one ``Checkpointer`` in one process, pages dropped,
4 alternating rounds: 1.15-1.28 s against 0.96-1.06 s buffered, with 3,000-5,000 involuntary context switches per
load against ~450 (the copy waits for the whole piece and contends for the 2 cores; the kernel copies a buffered
read's pages as they land). 2 MiB pieces on 16 threads, or pieces under 256 KiB left buffered: no better.

Remote files go through ``Storage.read_into``, whose requests run under the network deadline with
bounded retries: a piece that still fails raises once, naming the file. A storage serving memory
(``in_memory = True``: the shared-memory tier) is copied ``COPY_STEP`` bytes at a time, each step's
CRC taken right after its copy while it is still in the CPU cache (one 16 MiB copy then one CRC pass
read the bytes from memory twice).

Public so that other readers (Accelerate's stock files, the torch zip reader) can share it.
"""
from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..format.checksum import combine, crc32c
from ..errors import ConfigError, IntegrityError, StorageError
from ..storage.local import LocalStorage, open_regular
from ..storage.protocol import Storage

__all__ = ["PIECE_BYTES", "LOCAL_PIECE_BYTES", "READS_IN_FLIGHT", "COPY_STEP", "SEQUENTIAL_PIECE_BYTES",
           "STRATEGIES", "LOCAL_CRC_STEP", "Piece", "Range", "read_ranges", "tensor_bytes",
           "split", "prefetch", "pread_all"]

PIECE_BYTES = 16 << 20  # the remote tier's ranged-GET size too: big enough to amortise a request
# Raw cold O_DIRECT reads of the 1.48 GB shards on 8 threads (one process, medians of 3 on the shared VM):
# 0.58 s in 8 MiB pieces, 0.61 s in 4 MiB, 0.81 s in 16 MiB; 2 threads of 16 MiB: 1.06 s.
LOCAL_PIECE_BYTES = 8 << 20
READS_IN_FLIGHT = 8  # local reads queued at once (threads), whatever ``workers`` says: they wait on the disk
# How local files are read (``read.strategy``; ``fastckpt.read.strategy`` picks one per device): ``direct``
# (the above, O_DIRECT for the ranges marked ``direct``), ``parallel`` (the same pieces and threads, never
# O_DIRECT) or ``sequential`` (buffered, in file order, POSIX_FADV_SEQUENTIAL: the kernel's readahead keeps
# the disk busy ahead of the reads, which some virtual disks serve at least as fast as many queued requests).
STRATEGIES = ("sequential", "parallel", "direct")
# ``sequential``: ONE thread reads the pieces in file order, each in a single pread of up to this much, and a second
# thread (``fastckpt-read-check``) takes the CRC32C of each landed piece behind it, so the reads reach the disk
# strictly in order, back to back, and the readahead runs ahead of one stream. Cold ``load_into`` of the 0.63 GB
# flat state (150 tensors of 4 MiB, faulted-in targets), fresh process per load, pages dropped, 8 rounds in turns on
# the benchmark VM (2026-11-29): median 0.397 s so, against 0.454-0.509 s with two threads each reading and CRC'ing
# pieces in 2 MiB steps (the former design) and 0.396 s for a raw reader with no CRC at all. One thread reading
# 2 MiB at a time: 0.58 s (the disk idles between small requests); two threads sharing the reads: their requests
# interleave and the readahead sees two streams.
SEQUENTIAL_PIECE_BYTES = 16 << 20
# A buffered local read on several threads (``parallel``, and ``direct``'s unaligned ranges) is issued in steps of
# this much, each CRC'd right after its read while it is still in the CPU cache (an 8 MiB piece read whole, then
# CRC'd, reads its bytes from memory twice). Cold 1.48 GB ``load_into``, parallel, pages dropped, a fresh process per
# load, 12 alternating rounds on the benchmark VM (2026-11-29): median 1.025 s (best 0.957) in 2 MiB steps, 1.06 s
# (best 0.994) reading whole pieces, 1.04 s (best 0.943) with no verification at all. Unverified pieces are read in
# the same steps: in one 8 MiB pread each, the 0.63 GB flat state loaded in 0.554 s median against 0.493 s in steps
# (8 rounds in turns), as slow as the unverified load (0.560 s) that had been slower than the verified one.
LOCAL_CRC_STEP = 2 << 20
COPY_STEP = 1 << 20  # memory-backed storages: copy this much, then CRC it while it is in the CPU cache
_ALIGN = 4096  # O_DIRECT: file offset, length and memory address


@dataclass(slots=True)
class Range:
    """One verified byte range: ``[offset, offset + len(out))`` of ``path`` lands in ``out``.

    ``crc`` is the CRC32C the range must have (None: not verified); ``what`` names it in errors.
    """

    path: str
    offset: int
    out: memoryview
    crc: int | None = None
    what: str = ""
    direct: bool = False  # ``offset`` and ``out`` are page-aligned: read with O_DIRECT where the filesystem allows
    culprit: Callable[[memoryview], str] | None = None  # on a mismatch: what in ``out`` is corrupt (else ``what``)
    # ``on_piece(start, length)``: ``out[start:start + length]`` has landed (called by the thread that read it, after
    # its CRC, in no order); what it raises fails the read like a checksum mismatch (fastckpt.read.zipcheck)
    on_piece: Callable[[int, int], None] | None = None
    _crcs: list[int | None] = field(default_factory=list)
    _piece: int = PIECE_BYTES


@dataclass(frozen=True, slots=True)
class Piece:
    """A part of a ``Range`` read by one thread in one request."""

    range: Range
    index: int  # among the range's pieces, in order
    start: int  # within the range


def split(r: Range, piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """Cut ``r`` into pieces of at most ``piece_bytes`` (one empty piece for an empty range)."""
    starts = list(range(0, len(r.out), piece_bytes)) or [0]
    r._crcs = [None] * len(starts)
    r._piece = piece_bytes
    return [Piece(r, i, s) for i, s in enumerate(starts)]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's data (any dtype, 0-d included); the caller keeps ``t``."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def prefetch(storage: Storage, paths: Sequence[str]) -> None:
    """Ask the kernel to start reading every one of ``paths`` now (local files; a no-op elsewhere).

    A load reads a few files at a time; queueing the readahead of all of them at once keeps the disk busy
    between them (cold 1.48 GB loads on the benchmark VM: median 0.86 s against 0.95 s without).
    """
    if not isinstance(storage, LocalStorage) or not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            fd = open_regular(path)
        except (OSError, IntegrityError):
            continue  # the read itself reports a missing or non-regular file, naming it
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def read_ranges(storage: Storage, ranges: Sequence[Range], workers: int,
                on_done: Callable[[Range], None] | None = None, strategy: str = "direct") -> int:
    """Read every range on ``workers`` threads (local files: at least ``READS_IN_FLIGHT``), verifying each as
    its last piece arrives; return the bytes read. ``strategy`` (one of ``STRATEGIES``) says how local files
    are read; other storages ignore it.

    ``on_done(range)`` runs on the reading thread once a range is complete and verified (a CUDA copy,
    say). The first failure stops the rest and is raised once: ``IntegrityError`` naming the file and
    ``what`` on a checksum mismatch, ``StorageError`` naming the file on a read failure.
    """
    if strategy not in STRATEGIES:
        raise ConfigError(f"read strategy {strategy!r} is not one of {', '.join(STRATEGIES)} (read_ranges: "
                          "fastckpt.read.strategy.choose resolves read.strategy: auto to one of them)")
    job = _Job(storage, on_done, strategy)
    piece = PIECE_BYTES
    if job.local and strategy == "sequential":
        piece = SEQUENTIAL_PIECE_BYTES
    elif job.local:
        workers, piece = max(workers, READS_IN_FLIGHT), LOCAL_PIECE_BYTES
    pieces = [p for r in ranges for p in split(r, piece)]
    pieces.sort(key=lambda p: (p.range.path, p.range.offset + p.start))  # sequential per file: readahead helps
    try:
        if job.local and strategy == "sequential":
            job.in_order(pieces)
        elif workers <= 1 or len(pieces) <= 1:
            for p in pieces:
                job.one(p)
        else:
            with ThreadPoolExecutor(min(workers, len(pieces)), thread_name_prefix="fastckpt-read") as pool:
                for f in [pool.submit(job.one, p) for p in pieces]:
                    f.result()  # the first error; the others stop at their next piece
    finally:
        job.close()
    return sum(len(r.out) for r in ranges)


class _Job:
    """The shared state of one ``read_ranges`` call: open descriptors, the per-range countdown, the stop flag."""

    def __init__(self, storage: Storage, on_done: Callable[[Range], None] | None, strategy: str) -> None:
        self.storage = storage
        self.direct = strategy == "direct"  # the others never open O_DIRECT
        self.sequential = strategy == "sequential"
        self.local = isinstance(storage, LocalStorage)
        self.in_memory = bool(getattr(storage, "in_memory", False))
        self.on_done = on_done
        self.lock = threading.Lock()
        self.fds: dict[tuple[str, bool], int] = {}
        self.direct_refused: set[str] = set()  # files whose filesystem refused O_DIRECT: read buffered
        self.failed = threading.Event()

    def one(self, p: Piece) -> None:
        if self.failed.is_set():
            return
        try:
            self._arrived(p, self._read(p))
        except BaseException:
            self.failed.set()
            raise

    def in_order(self, pieces: Sequence[Piece]) -> None:
        """Read ``pieces`` on this thread, in order, one pread each; a checker thread CRCs each behind the reads
        (``SEQUENTIAL_PIECE_BYTES``). The first failure of either stops both and is raised here, once."""
        landed: queue.SimpleQueue[Piece | None] = queue.SimpleQueue()
        failure: list[BaseException] = []
        checker = threading.Thread(target=self._check_landed, args=(landed, failure), name="fastckpt-read-check",
                                   daemon=True)
        checker.start()
        try:
            for p in pieces:
                if self.failed.is_set():
                    break
                try:
                    self._read(p, check=False)
                except BaseException:
                    self.failed.set()
                    raise
                landed.put(p)
        finally:
            landed.put(None)  # the sentinel: the checker drains what landed (or skips it after a failure) and ends
            checker.join()
        if failure:
            raise failure[0]

    def _check_landed(self, landed: "queue.SimpleQueue[Piece | None]", failure: list[BaseException]) -> None:
        """The checker thread of ``in_order``: the CRC32C of each landed piece, then its bookkeeping (``_arrived``)."""
        while (p := landed.get()) is not None:
            if self.failed.is_set():
                continue  # keep taking pieces until the sentinel: the reader never blocks on a full queue
            try:
                r = p.range
                out = r.out[p.start: p.start + r._piece]
                self._arrived(p, crc32c(out) if r.crc is not None and len(out) else 0)
            except BaseException as e:  # noqa: BLE001 - handed to the reading thread, which raises it once
                failure.append(e)
                self.failed.set()

    def _read(self, p: Piece, check: bool = True) -> int:
        """Fill the piece; its CRC32C (0 when the range is not verified, or ``check`` is off: the caller CRCs it)."""
        r = p.range
        out = r.out[p.start: p.start + r._piece]
        check = check and r.crc is not None
        if not len(out):
            return 0
        if self.in_memory:  # copy and checksum step by step: the CRC reads the copy from the CPU cache
            value = 0
            for at in range(0, len(out), COPY_STEP):
                step = out[at: at + COPY_STEP]
                self.storage.read_into(r.path, r.offset + p.start + at, step)
                if check:
                    value = crc32c(step, value)
            return value
        if not self.local:
            self.storage.read_into(r.path, r.offset + p.start, out)
        else:
            try:
                if not self.sequential and not (r.direct and self.direct):  # buffered, among several threads
                    value = 0
                    for at in range(0, len(out), LOCAL_CRC_STEP):
                        step = out[at: at + LOCAL_CRC_STEP]
                        self._read_local(r, step, r.offset + p.start + at)
                        if check:
                            value = crc32c(step, value)
                    return value
                self._read_local(r, out, r.offset + p.start)
            except (OSError, EOFError) as e:
                raise StorageError(f"reading {r.path!r} failed: {e}; check the disk, or load an earlier checkpoint "
                                   "(Checkpointer.list())") from e
        return crc32c(out) if check else 0  # while the piece is hot in cache

    def _read_local(self, r: Range, out: memoryview, offset: int) -> None:
        cut = len(out) - len(out) % _ALIGN
        if r.direct and self.direct and cut and r.path not in self.direct_refused:
            fd = self._fd(r.path, direct=True)
            if fd is not None:
                try:
                    pread_all(fd, out[:cut], offset)
                    out, offset = out[cut:], offset + cut  # the sub-page tail (end of file) goes buffered
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct_refused.add(r.path)  # accepted at open, refused at read (some FUSE mounts)
        if len(out):
            pread_all(self._fd(r.path, direct=False), out, offset)  # type: ignore[arg-type]

    def _fd(self, path: str, direct: bool) -> int | None:
        """The descriptor of ``path`` (one per file and mode); None if O_DIRECT is refused there."""
        with self.lock:
            fd = self.fds.get((path, direct))
            if fd is None:
                flags = getattr(os, "O_DIRECT", 0) if direct else 0
                try:  # a FIFO would block the open, /dev/zero never end: refused before any read
                    fd = self.fds[(path, direct)] = open_regular(path, flags)
                except OSError as e:
                    if direct and e.errno == errno.EINVAL:  # tmpfs and some FUSE mounts reject O_DIRECT
                        self.direct_refused.add(path)
                        return None
                    raise StorageError(f"cannot open {path!r} for reading: {e}") from e
                if self.sequential and hasattr(os, "posix_fadvise"):  # a larger readahead window, at once
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return fd

    def _arrived(self, p: Piece, value: int) -> None:
        """Record the piece's checksum; the thread completing a range verifies it."""
        r = p.range
        if r.on_piece is not None:
            r.on_piece(p.start, min(r._piece, len(r.out) - p.start))
        with self.lock:
            r._crcs[p.index] = value
            complete = all(c is not None for c in r._crcs)
        if not complete:
            return
        if r.crc is not None:
            total = r._crcs[0] or 0
            for i, c in enumerate(r._crcs[1:], 1):
                total = combine(total, c or 0, min(r._piece, len(r.out) - i * r._piece))
            if total != r.crc:
                what = r.culprit(r.out) if r.culprit is not None else r.what
                raise IntegrityError(f"{r.path}: checksum mismatch{what} (CRC32C {total:#010x}, expected "
                                     f"{r.crc:#010x}); the file is corrupt. Load an earlier checkpoint "
                                     "(Checkpointer.list()).")
        if self.on_done is not None:
            self.on_done(r)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def pread_all(fd: int, out: memoryview, offset: int) -> None:
    """Fill ``out`` from ``fd`` at ``offset`` (``preadv`` until full: no seek, thread-safe); ``EOFError`` if the
    file ends first."""
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if not n:
            raise EOFError(f"file ended after {offset + got} bytes")
        got += n
