"""The seal of a lazy snapshot: on the training thread, before the commit, prove the sources did not move.

A lazy snapshot is committed only once sealed, at the first of: the watched optimizer's step pre-hook
(``wait_staged``), ``wait()``, ``close()``, the next ``save()``. By then staging is complete, and on the CPU every
in-place kernel the training thread launched has returned, so (i) a version counter that moved since ``save()``
proves a write, however late it was bumped (the copy thread's own checks leave a window of one kernel). On CUDA a
kernel queued before the seal may still be running: its counter has moved already (the bump happens at launch
on the host), and the gather of (ii) below is queued behind it on the current stream, so it still sees it.

(ii) Writes that skip the counter (``.data``, numpy or DLPack views, fused kernels) are caught by sampling one
64-byte cache line every ``stride`` bytes of each lazy tensor (whole tensors up to ``WHOLE`` bytes), at an offset
drawn per save. The stride is one 4 KiB page while the lazy bytes are few, and doubles until a save samples at most
``BUDGET`` runs: each run touches its own page (a TLB and a cache miss), and one per page of a 1.48 GB state cost
115 ms inside ``save()`` and again at the seal on the 2-core benchmark host; 11,000 runs, 2.5 ms. A run is a whole
cache line because the page touch is the cost, not the bytes: a write that changes a fraction f of a tensor's
elements (clipping) escapes a run with probability (1 - f)^16 in float32, not (1 - f)^2 as with the 8-byte runs
of before, so 4,096 line runs find it more surely than 16,384 of 8 bytes did, at a quarter of the page touches.

CPU tensors' samples are read straight from their memory by one numpy gather (engine/hostsamples.py), at positions
derived once per structure; the rest of this paragraph is about the others (CUDA). Their samples are views (no copy
per tensor), gathered by one ``torch.cat`` per dtype and device: every torch call
costs about 1 us of Python and dispatch, more once a training step has evicted the tensors' metadata from the
caches, and a state has hundreds of tensors (588, 441 of them under 64 KiB, in the GPT-2-small state of the
benchmarks): a copy per tensor made the samples 6 ms of a 13 ms ``save()``. The bytes compared are the raw ones
(a NaN equals itself; bools and dtypes ``cat`` lacks go as integers of their size).

At the seal the views of ``save()`` are gathered again as they are: a view reads the memory it was taken of, so
where a source still holds that memory (the same address and size: the views keep it alive, so no other storage can
take its address) its view shows what the source holds now. Rebuilding every window there (six torch calls a
tensor) held the optimizer step that sealed a 1.48 GB snapshot of 588 tensors 6-9 ms on the 2-core benchmark host;
two calls a tensor check the memory, and the step's wait fell to 3 ms (2026-11-29; ``moved()`` alone, warm, 4.3 ->
2.2 ms). A source that moved to other memory is compared through a window built anew, as before.

The samples are taken inside ``save()`` from the sources (on CUDA a small gather left on the device), compared by the
copy thread with the staged bytes right after each copy (off the training thread), and taken at the seal from the
sources again. Staged bytes that differ from save()'s prove the copy read a later write; sources that differ prove
a write since (undone or not). The staged buffers themselves need not stay alive (ring mode reuses them, and
holding them until the seal would stall the ring). A write through ``.data`` of a whole tensor (an EMA swap,
clipping) is caught by any sample; a sparse one into a large tensor can fall between the samples (the larger the
state, the sparser they are): such writes are likely to be caught, not certain.

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
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Sequence

import numpy as np
import torch

from ..errors import SnapshotMutatedError
from ..format.plan import Plan, TensorEntry
from .guard import VersionGuard
from .hostsamples import RUN, WHOLE, HostLayout, HostSamples, plain_host

__all__ = ["Seal", "PAGE", "WHOLE", "BUDGET", "RUN", "stride_for", "mutated_error"]

PAGE = 4096  # the smallest stride: one sample run per page
BUDGET = 4096  # sample runs (pages touched) per save at most: the stride grows with the state
_RNG = random.Random()  # its own: drawing from the global one would change the user's random stream (and resumes)
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NOTHING = nullcontext()  # reusable: it keeps no state


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


class _Run(NamedTuple):
    """Where a tensor is sampled, in elements of ``size`` bytes: ``count`` runs of ``per`` elements, one every
    ``step`` elements from element ``start`` (the whole tensor: one run of all of it)."""

    size: int
    start: int
    step: int
    count: int
    per: int

    def bytes_in(self, staged: np.ndarray, offset: int) -> bytes | memoryview:
        """The same bytes of a tensor staged at ``offset`` of ``staged`` (a shard's buffer as numpy bytes): numpy,
        not torch, so that no GIL hand-over happens per tensor."""
        rows = np.ndarray((self.count, self.per * self.size), np.uint8, buffer=staged,
                          offset=offset + self.start * self.size, strides=(self.step * self.size, 1))
        # a whole tensor (one run) is compared in place; sampled runs (a cache line a page) are copied out
        return rows.reshape(-1).data if self.count == 1 else rows.tobytes()

    def of_bytes(self, raw: torch.Tensor) -> torch.Tensor:
        """The same bytes in ``raw``, the tensor's bytes as staged (a flat uint8 tensor): a 2-D view, a run a row."""
        return raw.as_strided((self.count, self.per * self.size), (self.step * self.size, 1),
                              raw.storage_offset() + self.start * self.size)


def _window(t: torch.Tensor, stride: int, shift: int) -> tuple[torch.Tensor, _Run] | None:
    """The elements of ``t`` the seal compares, as a view (no copy: 1-D for a whole tensor, a run a row for a
    sampled one), and where they lie; None where no such view exists (non-contiguous, conj/neg views, empty).
    Called under ``torch.no_grad()``: a parameter's view then needs no detach (each torch call costs about 1 us,
    and a state has hundreds of tensors)."""
    # the conj bit only exists on complex tensors: asked only there (each query is a torch call, a GIL hand-over)
    if (t.layout is not torch.strided or t.is_quantized or not t.is_contiguous()
            or (t.dtype.is_complex and t.is_conj()) or t.is_neg()):
        return None  # quantized: no plain byte view; left, like the others, to the version counter
    n, size = t.numel(), t.element_size()
    if not n:
        return None
    nbytes = n * size
    if nbytes <= WHOLE:
        return t.view(-1), _Run(size, 0, n, 1, n)
    # a cache line a run, aligned within the tensor: the page touch is the cost, its line's other bytes are free
    first = (shift % (nbytes - RUN + 1)) & -RUN  # a tensor shorter than the stride still gets one run
    run = _Run(size, first // size, stride // size, (nbytes - RUN - first) // stride + 1, RUN // size)
    return t.as_strided((run.count, run.per), (run.step, 1), t.storage_offset() + run.start), run


def _cat(views: list[torch.Tensor]) -> torch.Tensor:
    """One copy of ``views`` (all of one dtype) as flat bytes. Bits, not values: bools (any byte may hide behind a
    bool written through a view) and a dtype ``cat`` lacks on the device go as the integers of their size."""
    dtype = views[0].dtype
    if dtype is not torch.bool:
        try:
            return torch.cat(views).view(-1).view(torch.uint8)
        except (RuntimeError, NotImplementedError):
            if dtype.itemsize not in _INTS:
                raise
    ints = _INTS[dtype.itemsize]
    return torch.cat([v.view(ints) for v in views]).view(-1).view(torch.uint8)


@dataclass
class _Samples:
    """Sampled elements of some tensors of one device, gathered: one flat uint8 tensor, grouped by dtype (widest
    first, so that each group's slice views back as its dtype), and each tensor's byte span in it."""

    order: list[int]  # tensor indices, in the order of ``flat``
    spans: dict[int, tuple[int, int]]
    shapes: dict[int, tuple[torch.dtype, torch.Size]]  # each tensor's window
    flat: torch.Tensor
    groups: list[list[torch.Tensor]]  # the windows gathered, one list per ``_cat``, in ``order``

    @staticmethod
    def gather(windows: Sequence[tuple[int, torch.Tensor]]) -> _Samples:
        groups: dict[tuple[torch.dtype, int], list[tuple[int, torch.Tensor]]] = {}
        for index, w in windows:  # one cat per dtype and shape kind: whole (1-D) or runs (2-D, a run a row)
            groups.setdefault((w.dtype, w.dim()), []).append((index, w))
        order, spans, shapes, cats, at = [], {}, {}, [], 0
        for dtype, dim in sorted(groups, key=lambda g: (-g[0].itemsize, g[1])):
            got = groups[(dtype, dim)]
            for index, w in got:
                order.append(index)
                end = at + w.numel() * dtype.itemsize
                spans[index], shapes[index], at = (at, end), (dtype, w.shape), end
            cats.append([w for _, w in got])
        samples = _Samples(order, spans, shapes, torch.empty(0), cats)
        samples.flat = samples.retake()
        return samples

    def retake(self) -> torch.Tensor:
        """The windows of ``gather`` gathered again: the bytes their memory holds now."""
        parts = [_cat(views) for views in self.groups]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def again(self, windows: dict[int, torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        """The same samples taken again from ``windows`` (by index; a missing one no longer has the same view: its
        slice of ``flat`` stands in, and its index is returned as changed)."""
        changed, now = [], []
        for index in self.order:
            w = windows.get(index)
            dtype, shape = self.shapes[index]
            if w is None or w.dtype != dtype:
                changed.append(index)
                start, end = self.spans[index]
                w = self.flat[start:end].view(dtype).view(shape)
            now.append((index, w))
        return _Samples.gather(now).flat, changed

    def differing(self, now: torch.Tensor) -> list[int]:
        """The indices whose span of ``now`` (a gather of the same order) differs from ``flat``: one comparison of
        the whole on the host, a search of the differences only when there are some."""
        if torch.equal(now, self.flat):
            return []
        starts = torch.tensor([self.spans[i][0] for i in self.order], dtype=torch.int64)
        where = torch.searchsorted(starts, now.ne(self.flat).nonzero().flatten(), right=True) - 1
        return [self.order[j] for j in torch.unique(where).tolist()]


@dataclass
class _DeviceSamples:
    """One CUDA device's samples of ``save()``: on the device, and copied to the host without blocking."""

    samples: _Samples
    segment: torch.Tensor  # on the device: the position in ``samples.order`` each sampled byte belongs to
    then_host: torch.Tensor  # pinned; valid once ``copied`` has completed
    copied: torch.cuda.Event
    answer: tuple[torch.Tensor, torch.cuda.Event] | None = None  # the seal's per-tensor mismatch counts (host)
    landed: bool = False  # ``copied`` was seen complete (by the copy thread)


class _Layout:
    """What a save's seal derives from its lazy entries and their sources before sampling: the stride, the CPU
    tensors' ``HostLayout``, and the other tensors (CUDA; sampled through torch views, per save)."""

    def __init__(self, tensors: Sequence[torch.Tensor | None], entries: list[TensorEntry]) -> None:
        self.stride = stride_for(sum(e.nbytes for e in entries if e.nbytes > WHOLE))
        host: list[tuple[int, torch.Tensor, TensorEntry]] = []
        self.others: list[TensorEntry] = []
        for e in entries:
            src = tensors[e.index]
            if src is None or not e.nbytes:
                continue
            if src.device.type == "cpu":
                if src.nbytes == e.nbytes and plain_host(src):
                    host.append((e.index, src, e))
            else:
                self.others.append(e)
        self.host = HostLayout(host, self.stride) if host else None


def _layout(tensors: Sequence[torch.Tensor | None], entries: Iterable[TensorEntry], reuse: tuple[Any, Plan] | None
            ) -> _Layout:
    """The seal's ``_Layout``; derived once per structure and plan where ``reuse`` = (token, plan) has a token (the
    state passed format/flatcache.py's identity check: the same tensors at the same addresses)."""
    token, plan = reuse if reuse is not None else (None, None)
    if token is None:
        return _Layout(tensors, list(entries))
    memo = token.memo.get("seal")
    if memo is None or memo[0] is not plan:
        memo = token.memo["seal"] = (plan, _Layout(tensors, list(entries)))
    return memo[1]


class Seal:
    """One lazy snapshot's seal: the version guard plus sampled elements of each lazy tensor."""

    def __init__(self, guard: VersionGuard, tensors: Sequence[torch.Tensor | None], keys: Sequence[str],
                 entries: Iterable[TensorEntry], reuse: tuple[Any, Plan] | None = None) -> None:
        """Called inside ``save()``, on the training thread: the sampled bytes of the moment of the snapshot.
        ``reuse``: (format/flatcache.py's token, the plan) of a state that passed the flattening's identity check:
        where the CPU tensors are sampled is then the previous save's, only the lines drawn anew."""
        self.guard = guard
        self._keys = keys
        layout = _layout(tensors, entries, reuse)
        self._stride = layout.stride
        self._shift = _RNG.randrange(self._stride)  # per save: a writer cannot learn which bytes are compared
        # CPU tensors: gathered from their memory, no torch call per tensor (engine/hostsamples.py)
        self._host: HostSamples | None = layout.host.take(self._shift, tensors) if layout.host is not None else None
        self._sources: dict[int, torch.Tensor] = {}
        self._memory: dict[int, tuple[int, int]] = {}  # each source's (address, size) at save(): see ``_held``
        self._dev_runs: dict[int, _Run] = {}
        per_device: dict[int, list[tuple[int, torch.Tensor]]] = {}
        with torch.no_grad() if layout.others else _NOTHING:  # a CPU state: no view to take
            for e in layout.others:
                src = tensors[e.index]
                got = None if src is None else _window(src, self._stride, self._shift)
                if got is None or src.nbytes != e.nbytes:
                    continue
                self._sources[e.index] = src  # its own reference: the copy loop drops the save's one
                self._memory[e.index] = (src.data_ptr(), e.nbytes)
                self._dev_runs[e.index] = got[1]
                per_device.setdefault(src.get_device() if src.is_cuda else -1, []).append((e.index, got[0]))
            # one gather per device; on CUDA queued on the current stream and kept there: no sync in save()
            self._cpu = _Samples.gather(per_device.pop(-1)) if -1 in per_device else None
            self._devices = {d: _gathered(d, got) for d, got in per_device.items()}
        self._where = {i: dev for dev in self._devices.values() for i in dev.samples.order}
        self._staged: set[int] = set()  # indices whose staged bytes the copy thread compared
        self._staged_moved: list[int] = []  # ... and found different from save()'s
        self._recorded = threading.Event()  # the copy thread has recorded every staged sample it will record
        self._cpu_np: np.ndarray | None = None  # ``self._cpu.flat`` as numpy, for the copy thread's comparisons
        self._pending = False  # the seal queued device comparisons, or staged ones are still due: verdict()

    def record(self, buf: torch.Tensor, entries: Iterable[TensorEntry]) -> None:
        """Called by the copy thread once ``entries`` are copied into ``buf`` (on CUDA: once the copies landed):
        their staged bytes compared with those of ``save()`` now, while the buffer is ours (ring mode reuses it).
        Host samples are compared as numpy bytes: no torch call per tensor, so the copy thread never hands the
        training thread's GIL back and forth per tensor (engine/onepass.py says why that matters)."""
        staged = None
        entries = entries if isinstance(entries, list) else list(entries)
        if self._host is not None:
            staged = buf.numpy()
            compared, moved = self._host.record(staged, entries)
            self._staged.update(compared)
            self._staged_moved += moved
        for e in entries if self._dev_runs else ():
            run = self._dev_runs.get(e.index)
            if run is None:
                continue
            dev = self._where.get(e.index)
            if dev is None:
                if staged is None:
                    staged = buf.numpy()
                start, end = self._cpu.spans[e.index]  # type: ignore[union-attr]
                same = run.bytes_in(staged, e.offset) == self._cpu_then()[start:end].data
            else:
                if not dev.landed:
                    dev.copied.synchronize()  # the copy thread waits, not the training thread
                    dev.landed = True
                start, end = dev.samples.spans[e.index]
                staged_t = run.of_bytes(buf[e.offset:e.offset + e.nbytes])
                same = torch.equal(staged_t, dev.then_host[start:end].view(run.count, run.per * run.size))
            if not same:
                self._staged_moved.append(e.index)
            self._staged.add(e.index)

    def _cpu_then(self) -> np.ndarray:
        """``save()``'s host samples as numpy bytes (made once, by the copy thread)."""
        if self._cpu_np is None:
            self._cpu_np = self._cpu.flat.numpy()  # type: ignore[union-attr]
        return self._cpu_np

    def let_go(self) -> None:
        """Called at the end of the seal, on the sealing thread: the sources and ``save()``'s views are no longer
        compared (the copy thread's later comparisons use the gathered bytes and spans only); dropped here."""
        self._sources = {}
        if self._host is not None:
            self._host.let_go()
        for samples in [self._cpu, *(dev.samples for dev in self._devices.values())]:
            if samples is not None:
                samples.groups = []

    def recorded(self) -> None:
        """Called by the copy thread (also when it failed) once it records no more: ``verdict()`` may compare."""
        self._recorded.set()

    def moved(self) -> list[str]:
        """Called on the training thread at the seal: the keys of the lazy tensors whose counter moved, or whose
        sampled bytes, as copied or as they are now, differ from those of ``save()``; CUDA tensors' comparisons are
        only queued here (``pending()``), their keys come from ``verdict()``."""
        moved = self.guard.moved() + list(self._staged_moved)
        if self._host is not None:
            moved += self._host.moved()
            if not self._recorded.is_set() and not self._host.recorded_all(self._staged):
                self._pending = True  # in a shard with CUDA tensors: compared after the seal (verdict())
        with torch.no_grad():
            if self._cpu is not None:
                now, changed = self._again(self._cpu)
                moved += changed + self._cpu.differing(now)
                if not self._recorded.is_set() and any(i not in self._staged for i in self._cpu.order):
                    self._pending = True  # in a shard with CUDA tensors: compared after the seal (verdict())
            for dev in self._devices.values():
                then = dev.samples.flat
                now, changed = self._again(dev.samples)
                moved += changed  # no longer the same plain tensor: known on the host
                # queued on the current stream, after every kernel the training thread launched before the seal
                with torch.cuda.device(then.device):
                    diff = torch.zeros(len(dev.samples.order), dtype=torch.int32, device=then.device)
                    diff.index_add_(0, dev.segment, now.ne(then).to(torch.int32))
                    host = torch.empty(diff.shape, dtype=diff.dtype, pin_memory=True)
                    host.copy_(diff, non_blocking=True)
                    done = torch.cuda.Event(blocking=True)  # a waiting committer sleeps, not spins
                    done.record()
                dev.answer = (host, done)
                self._pending = True
        return self._named(moved)

    def _again(self, samples: _Samples) -> tuple[torch.Tensor, list[int]]:
        """``samples`` taken again from the sources, and the indices no longer comparable: ``save()``'s views where
        every source still holds the memory they show, else windows built anew (``_Samples.again``)."""
        if self._held(samples.order):
            return samples.retake(), []
        return samples.again(self._windows(samples.order))

    def _held(self, order: Sequence[int]) -> bool:
        """Whether every source of ``order`` still holds the memory of ``save()`` (same address, same size), so
        that the window taken then shows its bytes now. No other storage can have taken that address: the window
        keeps the memory alive."""
        sources, memory = self._sources, self._memory
        for index in order:
            src = sources[index]
            if (src.data_ptr(), src.nbytes) != memory[index]:
                return False
        return True

    def _windows(self, order: Sequence[int]) -> dict[int, torch.Tensor]:
        """The sources' windows again, where each still has the view it had in ``save()``."""
        out = {}
        for index in order:
            got = _window(self._sources[index], self._stride, self._shift)
            if got is not None and got[1] == self._dev_runs[index]:
                out[index] = got[0]
        return out

    @property
    def _runs(self) -> dict[int, _Run]:
        """Where each lazy tensor is sampled this save (tests read the geometry)."""
        runs = {i: _Run(*r) for i, r in self._host.runs().items()} if self._host is not None else {}
        return {**runs, **self._dev_runs}

    def _named(self, indices: Iterable[int]) -> list[str]:
        keys: list[str] = []
        for i in indices:
            if self._keys[i] not in keys:
                keys.append(self._keys[i])
        return keys

    def pending(self) -> bool:
        """True once ``moved()`` queued device comparisons whose answer ``verdict()`` must still collect."""
        return self._pending

    def verdict(self, timeout: float | None = None) -> list[str]:
        """The keys of the tensors whose bytes at the seal (CUDA), or as staged, differ from those of ``save()``.
        Blocks until the seal's comparisons and the staged copies are done: the committer's call, or the seal's
        own where a retake must be decided at once."""
        self._recorded.wait(timeout)
        moved = list(self._staged_moved)
        for dev in self._devices.values():
            if dev.answer is None:
                continue
            host, done = dev.answer
            done.synchronize()
            moved += [index for index, count in zip(dev.samples.order, host.tolist()) if count]
        self._pending = False
        return self._named(moved)


def _gathered(device: int, got: list[tuple[int, torch.Tensor]]) -> _DeviceSamples:
    """One device's samples of ``save()`` gathered on it, and a non-blocking copy of them to the host."""
    with torch.cuda.device(device):
        samples = _Samples.gather(got)
        then = samples.flat
        sizes = [samples.spans[i][1] - samples.spans[i][0] for i in samples.order]
        # no pageable host-to-device copy (it waits for the stream) and no data-dependent size (it syncs)
        repeats = torch.tensor(sizes, dtype=torch.int64).pin_memory().to(then.device, non_blocking=True)
        segment = torch.repeat_interleave(torch.arange(len(sizes), device=then.device), repeats,
                                          output_size=then.numel())
        then_host = torch.empty(then.shape, dtype=then.dtype, pin_memory=True)
        then_host.copy_(then, non_blocking=True)
        copied = torch.cuda.Event(blocking=True)  # a waiting committer sleeps, not spins
        copied.record()
    return _DeviceSamples(samples, segment, then_host, copied)
