"""The seal of a lazy snapshot: on the training thread, before the commit, prove the sources did not move.

A lazy snapshot is committed only once sealed, at the first of: the watched optimizer's step pre-hook
(``wait_staged``), ``wait()``, ``close()``, the next ``save()``. By then staging is complete, and on the CPU every
in-place kernel the training thread launched has returned, so (i) a version counter that moved since ``save()``
proves a write, however late it was bumped (the copy thread's own checks leave a window of one kernel). On CUDA a
kernel queued before the seal may still be running: its counter has moved already (the bump happens at launch
on the host), and the gather of (ii) below is queued behind it on the current stream, so it still sees it.

(ii) Writes that skip the counter (``.data``, numpy or DLPack views, fused kernels) are caught by sampling ``RUN``
bytes every ``stride`` bytes of each lazy tensor (whole tensors up to ``WHOLE`` bytes), at an offset drawn per save.
The stride is one 4 KiB page while the lazy bytes are few, and doubles until a save samples at most ``BUDGET`` runs:
each run touches its own page (a TLB and a cache miss), and one per page of a 1.48 GB state cost 115 ms inside
``save()`` and again at the seal on the 2-core benchmark host (a strided copy: 28 ms; 11,000 runs: 0.5 ms).
The samples are taken inside ``save()`` from the sources (on CUDA a small gather left on the device), by the copy thread from the staged
bytes right after each copy, and at the seal from the sources again. Staged bytes that differ from save()'s prove
the copy read a later write; sources that differ prove a write since (undone or not). The staged buffers
themselves need not stay alive (ring mode reuses them, and holding them until the seal would stall the ring). A
write through ``.data`` of a whole tensor (an EMA swap, clipping) is caught by any sample; a sparse one into a large
tensor can fall between the samples (the larger the state, the sparser they are): such writes are likely to be
caught, not certain.

On CUDA nothing here may block the training thread per tensor: a host sync per tensor (``torch.equal``,
``.cpu()``) cost about 30 ms a seal for 450 tensors on an H200, and waiting for each shard's copies before queuing
the next one left the copy engine idle between shards. So the samples of ``save()`` are concatenated per device and
copied to the host once, without blocking; the seal's comparison runs on the device as one gather, one compare and
one segment sum per device, and only its per-tensor answer travels back, again without blocking. ``verdict()``
collects the answers: the committer calls it (``staging.on_mutation: raise``: the training thread never waits),
or the seal itself where a retake must be decided there and then (one wait, not one per tensor).
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ..errors import SnapshotMutatedError
from ..format.plan import TensorEntry
from .guard import VersionGuard

__all__ = ["Seal", "PAGE", "WHOLE", "BUDGET", "stride_for", "mutated_error"]

PAGE = 4096  # the smallest stride: one sample run per page
RUN = 8  # bytes per sample run
WHOLE = 64 * 1024  # tensors up to this size are compared whole
BUDGET = 16384  # sample runs per save at most (the stride grows with the state): about 1 ms of page touches
_RNG = random.Random()  # its own: drawing from the global one would change the user's random stream (and resumes)


def _bytes(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s values as a flat uint8 view, or None where no view exists (non-contiguous, conj/neg views)."""
    t = t.detach()
    if not t.is_contiguous() or t.is_conj() or t.is_neg() or t.numel() == 0:
        return None
    try:
        return t.reshape(-1).view(torch.uint8)
    except RuntimeError:  # a dtype with no byte view (quantized): left to the version counter
        return None


def stride_for(sampled_bytes: int) -> int:
    """The sampling stride (a power of two, at least a page) for ``sampled_bytes`` of tensors over ``WHOLE``."""
    stride = PAGE
    while sampled_bytes // stride > BUDGET:
        stride *= 2
    return stride


def mutated_error(name: str, keys: Sequence[str]) -> SnapshotMutatedError:
    """The refusal of checkpoint ``name``: ``keys`` changed between ``save()`` and the seal."""
    return SnapshotMutatedError(
        f"checkpoint {name!r}: {', '.join(repr(k) for k in keys)} changed after save() "
        "returned and before the snapshot was sealed (at the optimizer's step, wait(), close() or the next "
        "save()), so this checkpoint would hold values from after save(); it was discarded and the previous "
        "checkpoint is intact. A write that left the version counter alone (through `.data`, a numpy or "
        "DLPack view) is found by comparing sampled bytes. Call Checkpointer.wait_staged() before changing "
        "watched tensors outside optimizer.step(), set `staging.mode: eager`, or set "
        "`staging.on_mutation: retake` to take such a checkpoint again at the seal")


@dataclass
class _DeviceSamples:
    """One CUDA device's lazy tensors: their samples of ``save()``, concatenated, on the device and on the host."""

    indices: list[int]
    spans: list[tuple[int, int]]  # each tensor's [start, end) in the concatenation
    then: torch.Tensor  # on the device
    segment: torch.Tensor  # on the device: the tensor (position in ``indices``) each sampled byte belongs to
    then_host: torch.Tensor  # pinned; valid once ``copied`` has completed
    copied: torch.cuda.Event
    answer: tuple[torch.Tensor, torch.cuda.Event] | None = None  # the seal's per-tensor mismatch counts (host)


class Seal:
    """One lazy snapshot's seal: the version guard plus sampled bytes of each lazy tensor."""

    def __init__(self, guard: VersionGuard, tensors: Sequence[torch.Tensor | None], keys: Sequence[str],
                 entries: Iterable[TensorEntry]) -> None:
        """Called inside ``save()``, on the training thread: the sampled bytes of the moment of the snapshot."""
        self.guard = guard
        self._keys = keys
        entries = list(entries)
        self._stride = stride_for(sum(e.nbytes for e in entries if e.nbytes > WHOLE))
        self._shift = _RNG.randrange(self._stride - RUN)  # per save: a writer cannot learn which bytes are compared
        self._sources: dict[int, torch.Tensor] = {}
        self._at_save: dict[int, torch.Tensor] = {}  # CPU tensors' samples
        per_device: dict[int, list[tuple[int, torch.Tensor]]] = {}
        for e in entries:
            src = tensors[e.index]
            raw = None if src is None or not e.nbytes else _bytes(src)
            if raw is None or raw.numel() != e.nbytes:
                continue
            self._sources[e.index] = src  # its own reference: the copy loop drops the save's one
            if raw.is_cuda:  # a small gather queued on the current stream, kept on the device: no sync in save()
                per_device.setdefault(raw.device.index, []).append((e.index, self._sample(raw)))
            else:
                self._at_save[e.index] = self._sample(raw)
        self._devices = {d: _gathered(d, got) for d, got in per_device.items()}
        self._staged: dict[int, torch.Tensor] = {}
        self._recorded = threading.Event()  # the copy thread has recorded every staged sample it will record
        self._pending = False  # the seal queued device comparisons that verdict() collects
        self._late: list[int] = []  # CPU tensors whose staged samples came after the seal

    def _sample(self, raw: torch.Tensor) -> torch.Tensor:
        """``RUN`` bytes every stride of the contiguous byte view ``raw`` (all of it up to ``WHOLE`` bytes): one
        strided copy, no index tensor (an index gather read 8 index bytes per sampled byte, three times slower)."""
        n = raw.numel()
        if n <= WHOLE:
            return raw.clone()
        start = self._shift % (n - RUN + 1)  # a tensor shorter than the stride still gets one run
        rows = (n - RUN - start) // self._stride + 1
        return raw.as_strided((rows, RUN), (self._stride, 1), raw.storage_offset() + start).clone().reshape(-1)

    def record(self, buf: torch.Tensor, entries: Iterable[TensorEntry]) -> None:
        """Called by the copy thread once ``entries`` are copied into ``buf`` (on CUDA: once the copies landed)."""
        for e in entries:
            if e.index in self._sources:
                self._staged[e.index] = self._sample(buf[e.offset:e.offset + e.nbytes])

    def recorded(self) -> None:
        """Called by the copy thread (also when it failed) once it records no more: ``verdict()`` may compare."""
        self._recorded.set()

    def moved(self) -> list[str]:
        """Called on the training thread at the seal: the keys of the lazy tensors whose counter moved, or whose
        sampled bytes, as copied or as they are now, differ from those of ``save()``; CUDA tensors' comparisons are
        only queued here (``pending()``), their keys come from ``verdict()``."""
        keys = [self._keys[i] for i in self.guard.moved()]
        for index, then in self._at_save.items():
            key = self._keys[index]
            if key in keys:
                continue
            raw = _bytes(self._sources[index])
            now = None if raw is None else self._sample(raw)  # None: no longer a plain tensor (set_/resize)
            staged = self._staged.get(index)
            if now is None or now.shape != then.shape or not torch.equal(now, then) or (
                    staged is not None and not torch.equal(staged, then)):
                keys.append(key)
            elif staged is None and not self._recorded.is_set():
                self._late.append(index)  # in a shard with CUDA tensors: sampled after the seal (verdict())
                self._pending = True
        for dev in self._devices.values():
            nows = []
            for index, (start, end) in zip(dev.indices, dev.spans):
                raw = _bytes(self._sources[index])
                now = None if raw is None else self._sample(raw)
                if now is None or now.numel() != end - start:
                    if self._keys[index] not in keys:
                        keys.append(self._keys[index])  # no longer the same plain tensor: known on the host
                    now = dev.then[start:end]  # a placeholder that compares equal
                nows.append(now)
            # queued on the current stream, after every kernel the training thread launched before the seal
            with torch.cuda.device(dev.then.device):
                diff = torch.zeros(len(dev.indices), dtype=torch.int32, device=dev.then.device)
                diff.index_add_(0, dev.segment, torch.cat(nows).ne(dev.then).to(torch.int32))
                host = torch.empty(diff.shape, dtype=diff.dtype, pin_memory=True)
                host.copy_(diff, non_blocking=True)
                done = torch.cuda.Event(blocking=True)  # a waiting committer sleeps, not spins
                done.record()
            dev.answer = (host, done)
            self._pending = True
        return keys

    def pending(self) -> bool:
        """True once ``moved()`` queued device comparisons whose answer ``verdict()`` must still collect."""
        return self._pending

    def verdict(self, timeout: float | None = None) -> list[str]:
        """The keys of the CUDA tensors whose bytes at the seal, or as staged, differ from those of ``save()``.
        Blocks until the seal's comparisons and the staged copies are done: the committer's call, or the seal's
        own where a retake must be decided at once."""
        self._recorded.wait(timeout)
        keys = []
        for index in self._late:
            staged = self._staged.get(index)
            if staged is not None and not torch.equal(staged, self._at_save[index]):
                keys.append(self._keys[index])
        self._late = []
        for dev in self._devices.values():
            if dev.answer is None:
                continue
            host, done = dev.answer
            done.synchronize()
            dev.copied.synchronize()
            counts = host.tolist()
            for j, index in enumerate(dev.indices):
                start, end = dev.spans[j]
                staged = self._staged.get(index)
                if counts[j] or (staged is not None and not torch.equal(staged, dev.then_host[start:end])):
                    keys.append(self._keys[index])
        self._pending = False
        return keys


def _gathered(device: int, got: list[tuple[int, torch.Tensor]]) -> _DeviceSamples:
    """One device's samples of ``save()`` concatenated, and a non-blocking copy of them to the host."""
    sizes = [t.numel() for _, t in got]
    spans, at = [], 0
    for n in sizes:
        spans.append((at, at + n))
        at += n
    with torch.cuda.device(device):
        then = torch.cat([t for _, t in got])
        # no pageable host-to-device copy (it waits for the stream) and no data-dependent size (it syncs)
        repeats = torch.tensor(sizes, dtype=torch.int64).pin_memory().to(then.device, non_blocking=True)
        segment = torch.repeat_interleave(torch.arange(len(got), device=then.device), repeats, output_size=at)
        then_host = torch.empty(then.shape, dtype=then.dtype, pin_memory=True)
        then_host.copy_(then, non_blocking=True)
        copied = torch.cuda.Event(blocking=True)  # a waiting committer sleeps, not spins
        copied.record()
    return _DeviceSamples([i for i, _ in got], spans, then, segment, then_host, copied)
