"""One blocked pass over a staged shard: each tensor's CRC32C and its health statistics, block by block in cache.

Before, an I/O worker read every staged byte from DRAM once per statistic (aminmax, the float32 norms, the NaN
count when needed) and once more for the writer's checksums (the open layout's CRC32C, a torch file's CRC-32).
Here each block of a tensor (at most ``GRAIN`` values, 128 KiB of float32: it stays in the core's cache) is
checksummed, then reduced twice while it is still there: its min and max (whole-block calls: along a dimension
torch's min/max are ~100x slower), and the float32 L2 norm of each group of ``GROUP`` values. A NaN or an Inf makes its
block's extremes and its group's norm non-finite, so the common case's NaN/Inf test is one sum of the groups'
squares and one min/max of the blocks' extremes, no pass of its own: only flagged groups and blocks (rare) are
counted and measured again, value by value. The statistics are format/health.py's (docs/FORMAT.md, "Health"):
``n``, ``nan``, ``inf`` and ``absmax`` exact, ``l2`` within 1e-6 relative, ``fp`` (``fingerprint``) byte for byte.

Threads: torch reductions fan out over every core (intra-op threads, a process-wide setting) once one call sees
more than ``GRAIN`` (torch's ``at::internal::GRAIN_SIZE``) values. On a host of few CPUs an I/O worker runs at idle
priority beside the training thread, so no reduction there ever sees more: a block holds at most ``GRAIN`` values,
and stays serial. But each block costs some Python calls, and every call takes the GIL that the training thread
needs: on an H200 host (16 CPUs) the health pass of 1.96 GB in 128 KiB blocks added about 200 ms to the first
step after a save and 5 to 15 ms to each later one (gpu_bench, health on vs off). Where CPUs are many (``BLOCK``:
at least ``_MANY_CPUS``), a block holds ``GRAIN * 32`` values: 32 times fewer calls, and the reductions fan out
over CPUs the training thread does not use. So does a block where torch's intra-op pool is one thread
(``torch.set_num_threads(1)``, a common setting beside DataLoader workers): no reduction can fan out then, whatever
its size, and the calls per block are all that the small blocks cost. On 2 CPUs beside three CPU-bound processes
(the busy-host loop, 63 MB of float32 a checkpoint) the I/O workers' CPU per checkpoint went from 44.9 to about
39 ms (``python -m benchmarks.run --only busy``; a pass over 69 MB alone: 20.8 ms in 128 KiB blocks, 14.7 ms in
4 MiB ones, the reductions' floor about 13 ms).

The block's extremes: one ``aminmax`` for 16-bit floats, an ``amin`` and an ``amax`` for float32 and float64, which
torch's CPU kernels run faster there (one thread, 512 KiB of values in cache: float32 14.5 us against 21.5, float64 29
against 42, but bfloat16 48 against 13). Over 1 GiB of float32 from DRAM in 9 MiB tensors (AMD EPYC VM, 2026-11-30,
the variants in turns tensor by tensor) the pass took 170 and 179 ms of CPU per GiB split against 181 and 189 joint.
Smaller serial blocks, sized to stay in L2, cost more there: 181, 181, 186 and 201 ms per GiB in blocks of 4, 2, 1
and 0.5 MiB (bfloat16: 275, 270, 288, 324), so a block where nothing fans out stays ``GRAIN * 32`` values.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Sequence

import torch
import xxhash

from .checksum import crc32c

__all__ = ["tensor_pass", "shard_pass", "fingerprint", "fingerprints", "usable_cpus", "usable_cpu_ids", "block_values", "BLOCK",
           "GROUP", "GRAIN"]

GROUP = 512  # values normed together in float32; the groups' squares are summed in float64
GRAIN = 32768  # torch's GRAIN_SIZE: a reduction over more values may run on every core
_MANY_CPUS = 8


def usable_cpu_ids() -> list[int]:
    """The CPUs this process may run on (its affinity mask: a container's CPU set), ascending; [] where the OS
    cannot say."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def usable_cpus() -> int:
    """How many CPUs this process may run on (``usable_cpu_ids``), else the machine's count."""
    return len(usable_cpu_ids()) or os.cpu_count() or 1


def block_values() -> int:
    """Values per block of the pass (a multiple of GROUP), decided at each pass: torch's thread count may change."""
    return GRAIN * 32 if BLOCK > GRAIN or torch.get_num_threads() == 1 else GRAIN


BLOCK = GRAIN * 32 if usable_cpus() >= _MANY_CPUS else GRAIN  # the block while torch's pool has several threads
_SPLIT_EXTREMES = (torch.float32, torch.float64)  # an amin and an amax beat one aminmax here (module docstring)
_CHUNK = 1 << 22  # values measured at once when squares overflow float32 (rare): bounds float64 temporaries
_WINDOWS = 64  # sampled windows of the fingerprint...
_WINDOW = 64  # ...of this many bytes each: 4 KiB read per tensor, whatever its size
Checksum = Callable[[Any, int], int]  # continues a checksum over more bytes: crc32c, zlib's crc32
_NARROW = (torch.float16, torch.bfloat16, torch.float32)  # normed in float32 without any conversion


def fingerprint(data: Any, nbytes: int) -> str:
    """xxh3-64 of ``nbytes`` and of 64 evenly spread 64-byte windows of ``data`` (all of it up to 4 KiB)."""
    h = xxhash.xxh3_64()
    h.update(nbytes.to_bytes(8, "little"))
    mv = memoryview(data)
    if nbytes <= _WINDOWS * _WINDOW:
        h.update(mv)
    else:
        last = nbytes - _WINDOW
        for k in range(_WINDOWS):
            at = k * last // (_WINDOWS - 1)
            h.update(mv[at:at + _WINDOW])
    return h.hexdigest()


def fingerprints(data: Any, spans: Sequence[tuple[int, int]]) -> list[str]:
    """``fingerprint`` of each ``(offset, nbytes)`` span of ``data`` (a buffer), equal to it span for span, in a
    few numpy calls and one xxh3 call a span: the windows of every span gathered at once, each behind its 8-byte
    length (xxh3 over bytes fed in parts equals xxh3 over their concatenation). ``fingerprint`` takes 66 calls a
    tensor, each a GIL hold on the background thread that a launch-bound training thread waits behind."""
    import numpy as np

    u8 = np.frombuffer(data, dtype=np.uint8)
    out: list[str] = [""] * len(spans)
    big = [k for k, (_, n) in enumerate(spans) if n > _WINDOWS * _WINDOW]
    for k, (at, n) in enumerate(spans):
        if n <= _WINDOWS * _WINDOW:
            out[k] = fingerprint(u8[at:at + n], n)
    if big:
        at = np.array([spans[k][0] for k in big], dtype=np.int64)
        n = np.array([spans[k][1] for k in big], dtype=np.int64)
        starts = at[:, None] + np.arange(_WINDOWS, dtype=np.int64)[None, :] * (n - _WINDOW)[:, None] // (_WINDOWS - 1)
        windows = np.lib.stride_tricks.as_strided(u8, shape=(max(len(u8) - _WINDOW + 1, 0), _WINDOW),
                                                  strides=(1, 1), writeable=False)
        rows = np.empty((len(big), 8 + _WINDOWS * _WINDOW), dtype=np.uint8)
        rows[:, :8] = n.astype("<u8").view(np.uint8).reshape(-1, 8)
        rows[:, 8:] = windows[starts.reshape(-1)].reshape(len(big), -1)
        digest = xxhash.xxh3_64_hexdigest
        for j, k in enumerate(big):
            out[k] = digest(rows[j])
    return out


class _Values:
    """How a tensor's bytes become values the reductions take: native (float16/bfloat16/float32/float64 at their
    alignment), or converted block by block (float8 -> float32; integers, bool and odd byte counts -> float64,
    exact up to 2**53; a record staged off its dtype's alignment -> copied to an aligned scratch first)."""

    def __init__(self, raw: torch.Tensor, dtype: torch.dtype) -> None:
        size = torch.empty(0, dtype=dtype).element_size()
        if raw.numel() % size:
            dtype, size = torch.uint8, 1  # not a whole number of values: measured as bytes
        self.dtype, self.size = dtype, size
        self.per_elem = 2 if dtype.is_complex else 1  # a complex value is measured as its two real parts
        self.aligned = raw.storage_offset() % size == 0
        real = torch.empty(0, dtype=dtype)
        real = torch.view_as_real(real) if dtype.is_complex else real
        self.wide = real.dtype == torch.float64 or not real.is_floating_point()
        self.convert = None if real.dtype in _NARROW or real.dtype == torch.float64 else (
            torch.float32 if real.is_floating_point() else torch.float64)
        self.norm_dtype = torch.float64 if self.wide else torch.float32
        self.count = raw.numel() // size * self.per_elem  # values measured

    def of(self, raw: torch.Tensor) -> torch.Tensor:
        """The flat values of ``raw`` (whole elements)."""
        t = (raw if self.aligned else raw.clone()).view(self.dtype)
        if self.per_elem == 2:
            t = torch.view_as_real(t).reshape(-1)
        return t if self.convert is None else t.to(self.convert)


def tensor_pass(raw: torch.Tensor, dtype: torch.dtype, crc: bool | Checksum = False,
                block: int | None = None, fill: Callable[[int, int], None] | None = None
                ) -> tuple[dict[str, Any], int | None]:
    """One staged tensor's statistics (format/health.py's ``tensor_health``) and, with ``crc``, the checksum of its
    bytes (True: CRC32C; or a function ``(data, value) -> value`` that continues, zlib's ``crc32`` say), taken in
    one pass: ``raw`` is a flat uint8 CPU tensor, ``dtype`` its values' dtype. ``fill(at, n)``, when given, writes
    bytes ``at..at+n`` of ``raw`` right before the pass first reads them (the copy thread's one pass,
    engine/onepass.py: each block is measured while the copy has just put it in cache)."""
    checksum = crc32c if crc is True else crc or None
    kind = _Values(raw, dtype)
    nbytes, count = raw.numel(), kind.count
    groups = count // GROUP
    norms = torch.empty(groups, dtype=kind.norm_dtype)
    per_block = max(1, (block or block_values()) // GROUP)  # groups per block: a whole number of groups
    step = per_block * GROUP // kind.per_elem * kind.size  # bytes per block
    grouped = groups * GROUP // kind.per_elem * kind.size  # bytes of the whole groups; the rest is the tail
    blocks = -(-grouped // step)
    data = raw.numpy() if nbytes else b""
    value = 0
    los = his = None
    for b, at in enumerate(range(0, grouped, step)):
        block = raw[at:min(at + step, grouped)]
        if fill is not None:
            fill(at, block.numel())
        if checksum is not None:
            value = checksum(data[at:at + block.numel()], value)
        vals = kind.of(block)
        if los is None:
            los, his = torch.empty(blocks, dtype=vals.dtype), torch.empty(blocks, dtype=vals.dtype)
        # the whole block's min and max (whole-block calls: along dim=1 they are ~100x slower), then the norm
        # of each group: a NaN or an Inf makes both non-finite, so no isnan/isinf pass is needed here
        if vals.dtype in _SPLIT_EXTREMES:
            torch.amin(vals, out=los[b])
            torch.amax(vals, out=his[b])
        else:
            torch.aminmax(vals, out=(los[b], his[b]))
        torch.linalg.vector_norm(vals.view(-1, GROUP), 2, dim=1, dtype=kind.norm_dtype,
                                 out=norms[b * per_block:b * per_block + block.numel() * kind.per_elem
                                           // kind.size // GROUP])
    if fill is not None and grouped < nbytes:
        fill(grouped, nbytes - grouped)
    if checksum is not None and grouped < nbytes:
        value = checksum(data[grouped:nbytes], value)
    nan = inf = 0
    absmax, squares = 0.0, 0.0
    gbytes = GROUP // kind.per_elem * kind.size
    flagged: list[torch.Tensor] = []
    if groups:
        assert los is not None and his is not None
        absmax = _extremes(raw, kind, los, his, step, grouped)
        squares = _sum_squares(norms)
        if not math.isfinite(squares):  # rare: a NaN, an Inf or squares beyond float32 in some groups
            bad = ~torch.isfinite(norms)
            flagged = [kind.of(raw[at:at + gbytes]) for at in (bad.nonzero().flatten() * gbytes).tolist()]
            squares = _sum_squares(norms[~bad])
    tail = [kind.of(raw[grouped:nbytes])] if grouped < nbytes else []
    overflow = False
    for k, vals in enumerate(flagged + tail):  # measured value by value in float64: few values
        part = float(torch.linalg.vector_norm(vals, dtype=torch.float64))
        if not math.isfinite(part):  # a NaN or an Inf here: counted, and the finite values measured
            nan, inf = nan + int(torch.isnan(vals).sum()), inf + int(torch.isinf(vals).sum())
            vals = vals[torch.isfinite(vals)]
            part = float(torch.linalg.vector_norm(vals, dtype=torch.float64))
        if vals.numel():
            lo, hi = torch.aminmax(vals)
            absmax = max(absmax, -float(lo), float(hi))
        squares += part * part  # inf past float64, where ``**`` raises OverflowError
        if k < len(flagged) and not kind.wide:  # flagged for its squares alone? then they overflow float32
            overflow = overflow or not math.isfinite(float(torch.linalg.vector_norm(vals, dtype=torch.float32)))
    if overflow:  # squares beyond float32 somewhere: the whole tensor's in float64, as format/health.py did
        squares = _wide_squares(raw, kind)
    l2 = math.sqrt(squares)
    stats = {"n": count, "nan": nan, "inf": inf, "absmax": absmax if math.isfinite(absmax) else None,
             "l2": l2 if math.isfinite(l2) else None, "fp": fingerprint(data, nbytes)}
    return stats, (value & 0xFFFFFFFF if checksum is not None else None)


def _sum_squares(norms: torch.Tensor) -> float:
    """The sum of the squares of the groups' norms, in float64, at most GRAIN of them per call (serial)."""
    return sum(float(norms[at:at + GRAIN].to(torch.float64).square().sum()) for at in range(0, norms.numel(), GRAIN))


def _extremes(raw: torch.Tensor, kind: _Values, los: torch.Tensor, his: torch.Tensor, step: int,
              grouped: int) -> float:
    """The absolute max of the finite values in the whole groups, from each block's min and max (``los``,
    ``his``); a block whose extremes are not finite (a NaN or an Inf in it: rare) is measured again, finite values
    only."""
    lo, hi = float(los.min()), float(his.max())  # a NaN propagates: one test for every block
    if math.isfinite(lo) and math.isfinite(hi):
        return max(0.0, -lo, hi)
    sound = torch.isfinite(los) & torch.isfinite(his)
    absmax = 0.0
    for b in (~sound).nonzero().flatten().tolist():
        vals = kind.of(raw[b * step:min(b * step + step, grouped)])
        finite = vals[torch.isfinite(vals)]
        if finite.numel():
            lo_t, hi_t = torch.aminmax(finite)
            absmax = max(absmax, -float(lo_t), float(hi_t))
    if bool(sound.any()):
        absmax = max(absmax, -float(los[sound].min()), float(his[sound].max()))
    return absmax


def _wide_squares(raw: torch.Tensor, kind: _Values) -> float:
    """The sum of squares of the finite values of ``raw`` in float64, ``_CHUNK`` values at a time."""
    out = 0.0
    step = _CHUNK // kind.per_elem * kind.size
    for at in range(0, raw.numel() // kind.size * kind.size, step):
        vals = kind.of(raw[at:at + step])
        out += float(torch.linalg.vector_norm(vals[torch.isfinite(vals)], dtype=torch.float64)) ** 2
    return out


def shard_pass(raw: torch.Tensor, entries: Sequence[Any], keys: list[str], dtypes: Callable[[Any], torch.dtype],
               crc: bool | Checksum) -> tuple[dict[str, Any], list[int] | None]:
    """An I/O worker's one pass over a staged shard (``raw``: its uint8 buffer): each tensor's statistics by key
    and, with ``crc`` (``tensor_pass``), each tensor's checksum in ``entries`` order (what the writer records)."""
    stats: dict[str, Any] = {}
    crcs: list[int] = []
    for e in entries:
        s, c = tensor_pass(raw[e.offset:e.offset + e.nbytes], dtypes(e), crc)
        stats[keys[e.index]] = s
        crcs.append(c or 0)
    return stats, (crcs if crc else None)
