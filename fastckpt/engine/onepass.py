"""One pass over the bytes: the copy into the staging buffer, its CRC32C and its health statistics together
(``staging.crc_in_copy``, on by default).

Without it the copy thread moves the state into the slot (one read, one write of every byte) and the I/O workers
read it all again for the CRC32C the shard files record. With it the copy thread copies a shard's tensors chunk by
chunk and checksums each chunk of the *staged* copy right after copying it, while the chunk is still in cache, and
hands the CRCs to the writer (``Job.staged_crcs``), which then reads the bytes only to write them.

On the copy thread (serial: engine/serialops.py) the pass is batched (format/batchpass.py, ``copy_batched``): a
piece's tensors are copied by one ``torch._foreach_copy_``, then checksummed and measured in a few calls a piece,
so the background hands the GIL over a few hundred times a checkpoint, not tens of thousands (a launch-bound
training thread waits at each hand-over: ``python -m benchmarks.gilcalls``); once training waits for staging the
rest is copied in one call a shard (``copy_plain``). Elsewhere (no serial thread) the blocked pass below runs.

Both calls of the blocked pass release the GIL (``ctypes.memmove``; ``crc32c`` on buffers over 32 KiB), so the
training thread is not held behind them. Only CPU sources take the one pass (plain ones on the blocked pass): a CUDA
source lands by DMA, later, and its CRC is taken once it has (the writer or the shared-memory check); any other layout goes through ``copy_entries``.

The CRC is of the destination, never of the source: a source written during its copy (caught later by the
mutation guard and the seal) must not leave a file whose recorded CRC differs from its bytes.

Where health statistics are measured (``health.enabled``), the same pass takes them too (``copy_in_one_pass``):
format/healthpass.py's blocked pass over each staged tensor copies each block right before it checksums and reduces
it (its ``fill``), so the I/O workers neither checksum nor measure those shards, and read their bytes only to write
them. The statistics are of the staged bytes, as on the I/O workers.

The copy thread's pass takes longer than a plain copy (on the 2-core AMD EPYC VM, 1.48 GB of float32 state: staging
305 ms against 140, against 0.36 s training steps), and the next optimizer step waits for staging. So once a caller
blocks on staging (``SaveHandle.hurry``: the training thread's ``wait_staged``), the copy thread stages the remaining
shards plainly and the I/O workers checksum and measure them: the one pass never makes the training thread wait
longer than one shard's pass. Measured (``python -m benchmarks.run --only breakdown``, 3 runs each, 2026-11-30):
the background threads' CPU per checkpoint 485 ms (copy 130, I/O 345) in two passes against 335 ms (copy 285, I/O
40) in one, the stall per checkpoint 119 ms (104..243) against 83 ms (52..132), durable 835 against 709 ms.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Iterable, Sequence

import torch

from ..format import batchpass, fused
from ..format.batchpass import Layout, Part
from ..format.checksum import crc32c
from ..format.health import value_dtype
from ..format.healthpass import block_values, tensor_pass
from ..format.plan import Shard, TensorEntry
from .cudacopy import has_lazy_bits
from .serialops import is_serial
from .staging import copy_entries

__all__ = ["CHUNK", "batch_filler", "batch_layout", "copy_batched", "copy_in_one_pass", "copy_plain", "copy_with_crcs",
           "copy_with_health", "one_pass_sources", "plain_sources", "stage_batched"]

# Small enough to stay in a core's L2 (4 MiB here) between the copy and the checksum, large enough that the two
# calls per chunk cost nothing next to the bytes.
CHUNK = 1 << 20


def one_pass_sources(entries: Iterable[TensorEntry], tensors: list[torch.Tensor | None]) -> bool:
    """Whether the copy thread may stage ``entries`` in one pass: any CPU source on a serial thread (the batched
    pass copies with torch, which resolves strides and conj/neg bits; no GIL hand-over per tensor to ask), else
    plain ones (the blocked pass copies bytes)."""
    if is_serial():
        return all(e.nbytes == 0 or (tensors[e.index] is not None and tensors[e.index].is_cpu)  # type: ignore[union-attr]
                   for e in entries)
    return plain_sources(entries, tensors)


def plain_sources(entries: Iterable[TensorEntry], tensors: list[torch.Tensor | None]) -> bool:
    """Whether every non-empty entry's source is a contiguous CPU tensor holding exactly its values."""
    return all(e.nbytes == 0 or _plain(tensors[e.index]) for e in entries)


def _plain(t: torch.Tensor | None) -> bool:
    """Whether ``t`` is a contiguous CPU tensor holding exactly its values (no lazy conj/neg bit)."""
    return t is not None and t.device.type == "cpu" and t.is_contiguous() and not has_lazy_bits(t)  # no hand-over


def stage_batched(job: Any, shard: Shard, buf: torch.Tensor, one_pass: bool) -> bool:
    """Called by the copy thread (and ``save()`` for eager shards) with a shard of CPU sources: its one pass where
    ``one_pass`` (``staging.crc_in_copy``, the open layout) and training does not wait for staging yet, else on a
    serial thread a plain copy in one call; False where neither applies (the caller copies tensor by tensor)."""
    if not one_pass_sources(shard.entries, job.tensors):
        return False
    check = None if job.guard is None else job.guard.check  # the mutation guard's, around each tensor's copy
    if one_pass and not job.handle.hurry.is_set():
        copy_in_one_pass(job, shard, buf, shard.entries if job.guard is None else job.guard.around(shard.entries),
                         check)  # CRCs for the writer + the health statistics, if measured
    elif is_serial():
        copy_plain(job, shard, buf, check)
    else:
        return False
    return True


def batch_layout(job: Any, shard: Shard, buf: torch.Tensor, fmt: Any) -> Layout | None:
    """An I/O worker's: the batched pass's layout of ``shard`` (format/batchpass.py) where this thread is serial,
    else None (the blocked pass)."""
    return job.slot.layout(shard, buf, [value_dtype(fmt, e) for e in shard.entries]) if is_serial() else None


def copy_in_one_pass(job: Any, shard: Shard, buf: torch.Tensor, entries: Iterable[TensorEntry],
                     check: Callable[[int], None] | None = None) -> None:
    """The copy thread's one pass over ``shard`` (plain CPU sources, the open layout): its CRC32Cs into
    ``job.staged_crcs`` and, where measured, its tensors' statistics into ``job.health``, the shard then listed in
    ``job.staged_health`` so that its I/O worker does not measure it again. On a serial thread (the copy thread:
    engine/serialops.py) the batched pass (format/batchpass.py) does it in a few calls a piece, ``check`` (the
    mutation guard's) around each tensor's copy; elsewhere the blocked pass, over ``entries`` (the guard's
    checking iterator)."""
    if is_serial():
        copy_batched(job, shard, buf, check)
        return
    if job.health is None:
        crcs = copy_with_crcs(buf, entries, job.tensors)
    else:
        crcs, stats = copy_with_health(buf, entries, job.tensors, job.keys)
        job.health.update(stats)
        job.staged_health.add(shard.index)
    job.staged_crcs[shard.index] = [crcs[e.index] for e in shard.entries]


def copy_batched(job: Any, shard: Shard, buf: torch.Tensor, check: Callable[[int], None] | None) -> None:
    """The batched one pass (format/batchpass.py) of ``shard`` into ``buf``: copies, CRC32Cs and, where measured,
    statistics in a few calls a piece, ``check`` around each tensor's copy."""
    lay = job.slot.layout(shard, buf, [e.dtype for e in shard.entries])
    got = None
    if job.fused is not None:  # one compiled call for the shard (format/fused.py), checked around it as a whole
        if check is not None:
            for e in lay.entries:
                check(e.index)
        got = fused.run(job.fused, lay, tensors=job.tensors, health=job.health is not None, plain=_plain)
        if got is not None and check is not None:
            for e in lay.entries:
                check(e.index)
    crcs, stats = got or batchpass.run(lay, buf, checksum=crc32c, health=job.health is not None,
                                       fill=batch_filler(lay, job.tensors), check=check)
    if job.health is not None:
        job.health.update({job.keys[lay.entries[pos].index]: st for pos, st in stats.items()})
        job.staged_health.add(shard.index)
    job.staged_crcs[shard.index] = crcs  # in shard.entries order: the layout's positions


def copy_plain(job: Any, shard: Shard, buf: torch.Tensor, check: Callable[[int], None] | None) -> None:
    """Stage ``shard``'s CPU sources into ``buf`` in one ``torch._foreach_copy_``, nothing else (the copy thread
    once the training thread waits for staging: the I/O workers checksum and measure), ``check`` before and after."""
    lay = job.slot.layout(shard, buf, [e.dtype for e in shard.entries])
    if check is not None:
        for e in lay.entries:
            check(e.index)
    batch_filler(lay, job.tensors)(lay.wholes)
    if check is not None:
        for e in lay.entries:
            check(e.index)


def batch_filler(lay: Layout, tensors: list[torch.Tensor | None]) -> Callable[[Sequence[Part]], None]:
    """The batched pass's copy of a piece's parts from their sources: whole tensors in one ``torch._foreach_copy_``
    (one GIL hand-over however many), a part of a larger tensor by ``memmove`` (a source that is not a plain CPU
    tensor any more, a race on the state's layout, is copied whole by torch at its first part)."""
    base = lay.buf.data_ptr()
    plain: dict[int, bool] = {}  # per entry, asked once: each torch query is a GIL hand-over

    def fill(parts: Sequence[Part]) -> None:
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for p in parts:
            if p.n == 0:
                continue
            e = lay.entries[p.pos]
            src = tensors[e.index]
            dst = lay.views[p.pos]
            if src is None or src.dtype != dst.dtype or src.shape != dst.shape:
                raise ValueError(f"staging layout mismatch for tensor #{e.index}: the state changed shape "
                                 "while it was being saved")
            if p.whole:
                dsts.append(dst)
                srcs.append(src)
                continue
            if p.pos not in plain:
                plain[p.pos] = _plain(src)
            if plain[p.pos]:
                ctypes.memmove(base + e.offset + p.at, src.data_ptr() + p.at, p.n)
            elif p.at == 0:
                with torch.no_grad():
                    dst.copy_(src)
        if dsts:
            with torch.no_grad():  # a source that requires grad must not make the staged view part of a graph
                torch._foreach_copy_(dsts, srcs)
    return fill


def copy_with_health(buf: torch.Tensor, entries: Iterable[TensorEntry], tensors: list[torch.Tensor | None],
                     keys: list[str]) -> tuple[dict[int, int], dict[str, Any]]:
    """Copy each entry's (plain CPU) source into ``buf`` block by block inside the health pass of its staged bytes:
    the CRC32C of each entry's staged bytes by entry index, and each tensor's statistics by key."""
    crcs: dict[int, int] = {}
    stats: dict[str, Any] = {}
    block = min(block_values(), CHUNK // 4)  # values: a block the copy just wrote is still in cache when reduced
    for e in entries:
        raw = buf[e.offset: e.offset + e.nbytes]
        fill = _filler(buf, e, tensors) if e.nbytes else None
        stats[keys[e.index]], crc = tensor_pass(raw, e.dtype, crc=True, block=block, fill=fill)
        crcs[e.index] = crc or 0
    return crcs, stats


def _filler(buf: torch.Tensor, e: TensorEntry, tensors: list[torch.Tensor | None]) -> Callable[[int, int], None] | None:
    """What copies entry ``e``'s bytes ``at..at+n`` from its source into ``buf``; None when it was copied whole
    here (a source that is not a plain CPU tensor any more: a race on the state's layout)."""
    src = tensors[e.index].detach()  # type: ignore[union-attr]
    if e.offset + e.nbytes > buf.numel() or src.numel() * src.element_size() != e.nbytes:
        raise ValueError(f"staging layout mismatch for tensor #{e.index}: the state changed shape "
                         "while it was being saved")
    if not _plain(src):
        copy_entries(buf, [e], tensors)
        return None
    dst, sp = buf.data_ptr() + e.offset, src.data_ptr()
    return lambda at, n: ctypes.memmove(dst + at, sp + at, n)


def copy_with_crcs(buf: torch.Tensor, entries: Iterable[TensorEntry],
                   tensors: list[torch.Tensor | None]) -> dict[int, int]:
    """Copy each entry's (plain CPU) source into ``buf`` and return the CRC32C of each entry's staged bytes by
    entry index. ``entries`` may be the mutation guard's checking iterator: each entry is fully copied before the
    next is asked for."""
    view = memoryview(buf.numpy())
    out: dict[int, int] = {}
    for e in entries:
        if e.nbytes == 0:
            out[e.index] = crc32c(b"")
            continue
        fill = _filler(buf, e, tensors)
        if fill is None:  # copied whole: the caller checked, only a race on the state's layout gets here
            out[e.index] = crc32c(view[e.offset: e.offset + e.nbytes])
            continue
        crc = 0
        for o in range(0, e.nbytes, CHUNK):
            k = min(CHUNK, e.nbytes - o)
            fill(o, k)
            crc = crc32c(view[e.offset + o: e.offset + o + k], crc)
        out[e.index] = crc
    return out
