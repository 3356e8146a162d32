"""Host staging memory and the copies into it.

``HostArena`` owns reusable host buffers keyed by plan. A *slot* is one snapshot's
worth of buffers; slots are created on demand (up to ``slots``) so a loop whose
saves never overlap holds a single copy of the state. When ``max_host_bytes`` is
smaller than the state, one slot streams the shards through a ring of chunk
buffers that writers hand back, so staging memory stays bounded.

Buffers are page-aligned, exact-size ``mmap`` regions so writers can use O_DIRECT. On
CUDA they are also page-locked with ``cudaHostRegister`` (shared-memory ones too; engine/pinned.py), so
device-to-host copies run asynchronously on a side stream. A slot makes each buffer the first time a copier asks
for it (``Slot.buffer``), and keeps it for every later snapshot: eager shards' buffers inside ``save()``, lazy
shards' on the copy thread, so the first save of a lazy state allocates and page-locks nothing on the training
thread (2 GB took 0.8 s inside ``save()`` on an H200 when every buffer was made there).
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch

from ..format.batchpass import Layout
from ..format.checksum import crc32c
from ..format.plan import Plan, Shard, TensorEntry
from .pinned import Pinned, fs_type, host_buffer, loaded_cudart

__all__ = ["HostArena", "Pinned", "SharedStaging", "Slot", "copy_entries", "entry_view", "fs_type", "loaded_cudart",
           "staged_crcs"]


class SharedStaging(Protocol):
    """Where slot buffers live when they must outlive a crash (``staging.shm``: tiers/shm.py's ``ShmTier``).

    The engine holds it only through this protocol, so the tier above it can change without the engine."""

    def new_slot_dir(self) -> str:
        """Called by ``HostArena`` when it builds a slot: a fresh folder for that slot's buffers."""

    def alloc(self, slot_dir: str, index: int, nbytes: int) -> tuple[object, torch.Tensor]:
        """Called by ``HostArena`` per shard: a buffer of ``nbytes`` in ``slot_dir`` and what keeps it mapped."""

    def write_record(self, job: Any) -> None:
        """Called by the copy thread once a job is staged, before ``wait_staged()`` returns: its record."""

    def clear_record(self, slot_dir: str) -> None:
        """Called when a slot's snapshot is about to be overwritten or failed: it is no longer recoverable."""

    def mark_committed(self, slot_dir: str) -> None:
        """Called by the committer once the snapshot's checkpoint is committed: a restart may load from it."""

    def remove(self, slot_dir: str) -> None:
        """Called when a slot is dropped (a recovered one once persisted, or a failed allocation)."""

    def close(self) -> None:
        """Called once by ``HostArena.close``."""


def staged_crcs(buf: torch.Tensor, shard: Shard) -> list[int]:
    """CRC32C of each of ``shard``'s tensors as staged in ``buf`` (the record and the writer share them)."""
    data = memoryview(buf.numpy())
    return [crc32c(data[e.offset: e.offset + e.nbytes]) for e in shard.entries]


@dataclass(eq=False)
class Slot:
    """One snapshot's buffers. ``buffer(shard)`` may block in ring mode until a writer releases one."""

    plan: Plan
    ring: bool
    pinned: bool
    _buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    _free: list[torch.Tensor] = field(default_factory=list)
    _held: dict[int, torch.Tensor] = field(default_factory=dict)
    _keep: list[object] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    busy: bool = False
    dir: str | None = None  # shared-memory folder backing the buffers (staging.shm)
    recovered: bool = False  # adopted from a crashed process; not owned by an arena
    _failed: BaseException | None = None  # ring mode: a write of this snapshot failed; the copier stops with it
    # Makes a missing buffer: (this slot, shard index or None for a ring buffer, size) -> (what keeps it, the
    # buffer). Set by the arena (not bound to the slot: no reference cycle keeps a dropped slot's memory mapped);
    # None for a recovered slot, whose buffers all exist.
    make: Callable[["Slot", int | None, int], tuple[object, torch.Tensor]] | None = None
    ring_count: int = 0  # ring mode: how many buffers of ``ring_bytes`` it may make
    ring_bytes: int = 0
    _made: int = 0  # ring mode: buffers made (or being made) so far
    broken: bool = False  # making a buffer failed: the arena drops the slot at its release instead of reusing it
    _layouts: dict[tuple, Layout] = field(default_factory=dict)  # the batched pass's, per (shard, buffer, dtypes)
    _views: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # per (shard, buffer)

    def adopt(self, index: int, buffer: torch.Tensor, keep: object) -> None:
        """Called by ``tiers.shm`` while recovering a slot: shard ``index`` is the existing ``buffer``, and ``keep``
        (what backs it, e.g. its mapping) lives as long as the slot."""
        self._keep.append(keep)
        self._buffers[index] = buffer

    def buffer(self, shard: Shard, timeout: float | None = None) -> torch.Tensor:
        """Called by the copier before filling ``shard``: its buffer, made (and page-locked) now if this slot never
        held it, on the calling thread (``save()`` for an eager shard, the copy thread for a lazy one). In ring
        mode it raises the error ``fail()`` was given instead of waiting for a buffer that a failed snapshot would
        never need again."""
        if not self.ring:
            buf = self._buffers.get(shard.index)
            if buf is None:
                buf = self._buffers[shard.index] = self._new(shard.index, shard.nbytes)
            return buf
        with self._cond:
            grow = not self._free and self._failed is None and self._made < self.ring_count
            if grow:
                self._made += 1  # reserved under the lock, made outside it: writers release meanwhile
            elif not self._cond.wait_for(lambda: bool(self._free) or self._failed is not None, timeout):
                raise TimeoutError("no staging buffer was released in time")
            elif self._failed is not None:
                raise self._failed
            else:
                buf = self._free.pop()
                self._held[shard.index] = buf
                return buf
        try:
            buf = self._new(None, self.ring_bytes)
        except BaseException:
            with self._cond:
                self._made -= 1
            raise
        with self._cond:
            self._held[shard.index] = buf
        return buf

    def _new(self, index: int | None, nbytes: int) -> torch.Tensor:
        if self.make is None:
            raise RuntimeError(f"staging slot {self.dir or ''} has no buffer for shard {index} and cannot make one")
        try:
            keep, buf = self.make(self, index, nbytes)
        except BaseException:
            self.broken = True  # some buffers may exist, a shm file may be half made: never reused
            raise
        self._keep.append(keep)
        return buf

    def layout(self, shard: Shard, buf: torch.Tensor, dtypes: list[torch.dtype]) -> Layout:
        """Called by the copy thread and the I/O workers: the batched pass's pieces and views of ``shard`` staged
        in ``buf`` (format/batchpass.py), made the first time and reused by every later snapshot in this slot."""
        key = (shard.index, buf.data_ptr(), tuple(dtypes))
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = Layout.of(buf, shard.entries, dtypes)
        return lay

    def views(self, shard: Shard, buf: torch.Tensor) -> list[torch.Tensor]:
        """Called by the copy thread (and ``save()``) before queuing a CUDA shard's copies: each entry's slice of
        ``buf`` with its dtype and shape (``entry_view``), made the first time and reused by every later snapshot in
        this slot (three torch calls a tensor, each a GIL hand-over, saved at every save)."""
        key = (shard.index, buf.data_ptr())
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = [entry_view(buf, e) for e in shard.entries]
        return views

    def keeps(self) -> list[object]:
        """What keeps this slot's buffers (mappings, ``Pinned`` registrations), for the arena to release."""
        return list(self._keep)

    def held(self, shard: Shard) -> torch.Tensor:
        """Called by the writer: the buffer currently holding ``shard``."""
        return self._buffers[shard.index] if not self.ring else self._held[shard.index]

    def release(self, shard: Shard) -> None:
        """Called by the writer once ``shard`` is on storage (ring mode recycles the buffer)."""
        if self.ring:
            with self._cond:
                buf = self._held.pop(shard.index, None)
                if buf is not None:
                    self._free.append(buf)
                    self._cond.notify()

    def fail(self, error: BaseException) -> None:
        """Called by a writer whose shard failed: the snapshot is lost, so the copier (``save()`` itself when
        eager, the copy thread when lazy) stops at its next ``buffer()`` with ``error`` (the first one) instead of
        copying the rest into buffers only more doomed writes would free. Only ring mode waits for buffers."""
        if self.ring:
            with self._cond:
                if self._failed is None:
                    self._failed = error
                self._cond.notify_all()

    def reset(self) -> None:
        """Called when a snapshot ends (success or failure): every ring buffer is free again, for the next one."""
        if self.ring:
            with self._cond:
                self._free.extend(self._held.values())
                self._held.clear()
                self._failed = None
                self._cond.notify_all()


class HostArena:
    """Reusable staging buffers. ``allocations``/``allocated_bytes`` let tests prove reuse."""

    def __init__(self, slots: int, max_host_bytes: int | None, shm: "SharedStaging | None" = None) -> None:
        self._shm = shm
        self._max_slots = slots
        self._limit = max_host_bytes
        self._slots: dict[int, list[Slot]] = {}
        self._cond = threading.Condition()
        self._counts = threading.Lock()
        self.allocations = 0
        self.allocated_bytes = 0

    def acquire(self, plan: Plan, pin: bool, block: bool, timeout: float | None = None) -> Slot | None:
        """Called by ``save()``: a free slot for ``plan``, or None when busy and not blocking."""
        with self._cond:
            while True:
                slot = self._try_acquire(plan, pin)
                if slot is not None:
                    slot.busy = True
                    if slot.dir is not None and self._shm is not None:
                        self._shm.clear_record(slot.dir)  # its committed snapshot is about to be overwritten
                    return slot
                if not block:
                    return None
                if not self._cond.wait(timeout):
                    raise TimeoutError("all staging slots stayed busy")

    def release(self, slot: Slot) -> None:
        """Called by the committer when a snapshot is finished with its buffers. A slot that failed to make a
        buffer is dropped (its shared-memory folder too): the next save makes a fresh one."""
        slot.reset()
        with self._cond:
            slot.busy = False
            if slot.broken:
                mine = self._slots.get(slot.plan.plan_id, [])
                if slot in mine:
                    mine.remove(slot)
                self._drop([slot])
            self._cond.notify_all()

    def _try_acquire(self, plan: Plan, pin: bool) -> Slot | None:
        mine = self._slots.setdefault(plan.plan_id, [])
        for slot in mine:
            if not slot.busy and slot.pinned == pin:
                return slot
        if len(mine) >= self._max_slots_for(plan):
            # An idle slot of the other kind (the state moved between CPU and CUDA with the same
            # layout) is replaced; otherwise waiting for it to free would wait forever.
            other = [s for s in mine if not s.busy and s.pinned != pin]
            if not other:
                return None
            self._drop(other[:1])
            mine.remove(other[0])
        # Other plans' idle buffers are dropped first so memory tracks the live structure.
        self._evict_idle(keep=plan.plan_id)
        slot = self._new_slot(plan, pin)
        mine.append(slot)
        return slot

    def slot_bytes(self, plan: Plan) -> int:
        """The host memory one slot of ``plan`` takes once every buffer is made (ring mode: its ring's)."""
        shards = plan.mine(plan.shards)
        count, size = self._ring(plan, shards)
        return count * size if count else sum(s.nbytes for s in shards)

    def _ring(self, plan: Plan, shards: list[Shard]) -> tuple[int, int]:
        """Ring mode: how many buffers a slot may make and their size; (0, 0) otherwise."""
        if not self._ring_mode(plan) or not shards:
            return 0, 0
        biggest = max(s.nbytes for s in shards)
        return min(max(2, self._limit // max(biggest, 1)), len(shards)), biggest  # type: ignore[operator]

    def _max_slots_for(self, plan: Plan) -> int:
        mine = sum(s.nbytes for s in plan.mine(plan.shards))
        if self._limit is None or mine == 0:
            return self._max_slots
        return max(1, min(self._max_slots, self._limit // mine))

    def _ring_mode(self, plan: Plan) -> bool:
        mine = sum(s.nbytes for s in plan.mine(plan.shards))
        return self._limit is not None and mine > self._limit

    def _new_slot(self, plan: Plan, pin: bool) -> Slot:
        """A slot with no buffer yet: ``Slot.buffer`` makes each one where it is first needed (``_make``)."""
        ring = self._ring_mode(plan)
        slot = Slot(plan=plan, ring=ring, pinned=pin)
        slot.ring_count, slot.ring_bytes = self._ring(plan, plan.mine(plan.shards))  # other ranks stage the rest
        if not slot.ring_count and self._shm is not None:
            slot.dir = self._shm.new_slot_dir()
        # save() selects the state's first device: buffers made later (on the copy thread) register under it too,
        # so no stray context opens on GPU 0
        device = torch.cuda.current_device() if pin and torch.cuda.is_initialized() else None
        slot.make = functools.partial(self._make, pin, device)
        return slot

    def _make(self, pin: bool, device: int | None, slot: Slot, index: int | None,
              nbytes: int) -> tuple[object, torch.Tensor]:
        """One buffer of ``slot`` (``index`` None: a ring buffer), page-locked when ``pin``: a shared-memory file
        of ``staging.shm`` (its pages reserved: a full tmpfs raises ``StorageError`` here), else anonymous memory."""
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            if slot.dir is None or self._shm is None or index is None:
                keep, buf = host_buffer(nbytes, pin)
            else:
                keep, buf = self._shm.alloc(slot.dir, index, nbytes)
                if pin:  # crash recovery in GPU training: the shm mapping itself takes the async copies
                    keep = Pinned(keep, buf, f"shared memory under {slot.dir}", slot.dir)  # type: ignore[arg-type]
        self._count(nbytes)
        return keep, buf

    def _count(self, nbytes: int) -> None:
        with self._counts:  # save() and the copy thread both make buffers
            self.allocations += 1
            self.allocated_bytes += nbytes

    def _evict_idle(self, keep: int) -> None:
        for plan_id in list(self._slots):
            if plan_id == keep:
                continue
            live = [s for s in self._slots[plan_id] if s.busy]
            self._drop([s for s in self._slots[plan_id] if not s.busy])
            if live:
                self._slots[plan_id] = live
            else:
                del self._slots[plan_id]

    def _drop(self, slots: list[Slot]) -> None:
        for slot in slots:
            slot._layouts.clear()  # their views hold the buffers
            slot._views.clear()
            for keep in slot.keeps():
                if isinstance(keep, Pinned):
                    keep.release()
            if slot.dir is not None and self._shm is not None:
                self._shm.remove(slot.dir)

    @property
    def shm(self) -> "SharedStaging | None":
        """The shared-memory tier backing the slots, if any (the pipeline writes its records)."""
        return self._shm

    def close(self) -> None:
        """Drop every buffer (called by ``Checkpointer.close``)."""
        with self._cond:
            for slots in self._slots.values():
                self._drop(slots)
            self._slots.clear()
        if self._shm is not None:
            self._shm.close()


def entry_view(buf: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The slice of ``buf`` holding ``entry``, viewed with its dtype and shape."""
    raw = buf[entry.offset: entry.offset + entry.nbytes]
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    return raw.view(entry.dtype).view(entry.shape)


def _plain_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory is exactly its values, back to back, in host memory (``flatten`` has
    already refused every layout but strided)."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def copy_entries(buf: torch.Tensor, entries: Iterable[TensorEntry], tensors: list[torch.Tensor | None]) -> None:
    """Copy each entry's source tensor into ``buf``, now (a CUDA source's copies are queued in batches by
    engine/cudacopy.py instead; one given here is copied synchronously)."""
    for e in entries:
        if e.nbytes == 0:
            continue
        src = tensors[e.index].detach()  # type: ignore[union-attr]
        if _plain_bytes(src):
            # libc memmove (GIL released) runs at about twice the bandwidth of a single-threaded
            # Tensor.copy_ on the hosts we measured, and the copy thread's time is what training
            # competes with. The slot's buffers never alias a live tensor, and a corrupt offset
            # is caught by the bounds check below rather than by a stray write.
            if e.offset + e.nbytes > buf.numel() or src.numel() * src.element_size() != e.nbytes:
                raise ValueError(f"staging layout mismatch for tensor #{e.index}: the state changed shape "
                                 "while it was being saved")
            ctypes.memmove(buf.data_ptr() + e.offset, src.data_ptr(), e.nbytes)
            continue
        entry_view(buf, e).copy_(src)
