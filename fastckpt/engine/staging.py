"""Host staging memory and the copies into it.

``HostArena`` owns reusable host buffers keyed by plan. A *slot* is one snapshot's
worth of buffers; slots are created on demand (up to ``slots``) so a loop whose
saves never overlap holds a single copy of the state. When ``max_host_bytes`` is
smaller than the state, one slot streams the shards through a ring of chunk
buffers that writers hand back, so staging memory stays bounded.

Buffers are page-aligned, exact-size ``mmap`` regions so writers can use O_DIRECT. On
CUDA they are also page-locked with ``cudaHostRegister`` (shared-memory ones too), so
device-to-host copies run asynchronously on a side stream. Not ``torch.empty(pin_memory=True)``:
the caching host allocator rounds every buffer up to a power of two and keeps it after close.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol

import torch

from ..errors import FastCkptError
from ..format.checksum import crc32c
from ..format.plan import Plan, Shard, TensorEntry

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


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, not only the current one


class Pinned:
    """Keeps ``mm`` page-locked for CUDA (``cudaHostRegister``) until ``release()`` or collection."""

    def __init__(self, mm: mmap.mmap, buf: torch.Tensor, what: str, folder: str | None = None) -> None:
        self.mm = mm
        self._ptr = buf.data_ptr()
        self._pid = os.getpid()  # a fork()ed child inherits the mapping, not the registration nor a CUDA context
        # The device current at registration (save() selects the state's first device): the unregistration runs
        # under it too, so a close() or a collection on another thread opens no context on GPU 0.
        self._device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        err = int(torch.cuda.cudart().cudaHostRegister(self._ptr, len(mm), _HOST_REGISTER_PORTABLE))
        if err != 0:
            self._ptr = 0
            # The failed call left CUDA's last error set: the next kernel launch check would raise it, naming the
            # kernel instead of the registration. This error is reported here, so clear it.
            clear_last_cuda_error()
            fs = None if folder is None else fs_type(folder)
            if fs is not None and fs not in _PINNABLE_FS:
                # Measured on kernel 6.18 (H200 machine): a file mapping on tmpfs pins, one on ext4 fails with
                # error 1. Linux refuses long-term pins of writable pages of disk-backed files.
                raise FastCkptError(f"cannot page-lock {len(mm)} bytes of {what} for CUDA copies (cudaHostRegister "
                                    f"error {err}): that folder is on {fs}, and the kernel page-locks file-backed "
                                    "memory only on tmpfs; set staging.shm_dir to a tmpfs folder (/dev/shm)")
            raise FastCkptError(f"cannot page-lock {len(mm)} bytes of {what} for CUDA copies (cudaHostRegister "
                                f"error {err}); lower staging.max_host_bytes, or set staging.shm=false if it is on")

    def release(self) -> None:
        """Called when the arena drops the buffer: unlock it before it is unmapped."""
        ptr, self._ptr = self._ptr, 0
        if ptr and os.getpid() == self._pid:  # in a fork()ed child any CUDA call fails: the parent owns it
            with torch.cuda.device(self._device) if self._device is not None else contextlib.nullcontext():
                torch.cuda.cudart().cudaHostUnregister(ptr)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the process frees it anyway
            pass


_PINNABLE_FS = {"tmpfs", "hugetlbfs", "ramfs"}  # memory-backed: cudaHostRegister accepts their file mappings


def fs_type(path: str) -> str | None:
    """The type of the file system holding ``path`` (its longest mount point in /proc/mounts), None if unknown."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind


def clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error of this thread (``cudaGetLastError``), which torch's bindings do not
    expose: through the libcudart this process has loaded (found in ``/proc/self/maps``). Nothing to do where none
    is loaded separately (a statically linked runtime)."""
    lib = loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


def loaded_cudart() -> Any:
    """The CUDA runtime library this process has loaded (``ctypes.CDLL``), or None where none is loaded separately
    (a CPU-only build, a statically linked runtime): torch's bindings lack some calls (``fastckpt.engine.streams``)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)  # already loaded: the same library instance (and error state) torch uses
        except OSError:
            continue
    return None


def _alloc(nbytes: int, pin: bool) -> tuple[object, torch.Tensor]:
    # Page-aligned and zero-filled lazily by the kernel. No MADV_HUGEPAGE: with THP defrag
    # set to "madvise", first touches can stall in direct compaction.
    mm = mmap.mmap(-1, max(nbytes, 1))
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    return (Pinned(mm, buf, "host staging memory") if pin else mm), buf


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

    def adopt(self, index: int, buffer: torch.Tensor, keep: object) -> None:
        """Called by ``tiers.shm`` while recovering a slot: shard ``index`` is the existing ``buffer``, and ``keep``
        (what backs it, e.g. its mapping) lives as long as the slot."""
        self._keep.append(keep)
        self._buffers[index] = buffer

    def buffer(self, shard: Shard, timeout: float | None = None) -> torch.Tensor:
        """Called by the copier before filling ``shard``. In ring mode it raises the error ``fail()`` was given
        instead of waiting for a buffer that a failed snapshot would never need again."""
        if not self.ring:
            return self._buffers[shard.index]
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._free) or self._failed is not None, timeout):
                raise TimeoutError("no staging buffer was released in time")
            if self._failed is not None:
                raise self._failed
            buf = self._free.pop()
            self._held[shard.index] = buf
            return buf

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
        """Called by the committer when a snapshot is finished with its buffers."""
        slot.reset()
        with self._cond:
            slot.busy = False
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

    def _max_slots_for(self, plan: Plan) -> int:
        mine = sum(s.nbytes for s in plan.mine(plan.shards))
        if self._limit is None or mine == 0:
            return self._max_slots
        return max(1, min(self._max_slots, self._limit // mine))

    def _ring_mode(self, plan: Plan) -> bool:
        mine = sum(s.nbytes for s in plan.mine(plan.shards))
        return self._limit is not None and mine > self._limit

    def _new_slot(self, plan: Plan, pin: bool) -> Slot:
        ring = self._ring_mode(plan)
        slot = Slot(plan=plan, ring=ring, pinned=pin)
        shards = plan.mine(plan.shards)  # other ranks stage the rest
        if ring and shards:
            biggest = max(s.nbytes for s in shards)
            count = max(2, self._limit // max(biggest, 1))  # type: ignore[operator]
            count = min(count, len(shards))
            for _ in range(count):
                keep, buf = _alloc(biggest, pin)
                slot._keep.append(keep)
                slot._free.append(buf)
                self._count(biggest)
        elif self._shm is not None:
            slot.dir = self._shm.new_slot_dir()
            try:
                for shard in shards:
                    keep, buf = self._shm.alloc(slot.dir, shard.index, shard.nbytes)
                    if pin:  # crash recovery in GPU training: the shm mapping itself takes the async copies
                        keep = Pinned(keep, buf, f"shared memory under {slot.dir}", slot.dir)  # type: ignore[arg-type]
                    slot._keep.append(keep)
                    slot._buffers[shard.index] = buf
                    self._count(shard.nbytes)
            except BaseException:
                self._shm.remove(slot.dir)  # a full tmpfs: give back what was reserved
                raise
        else:
            for shard in shards:
                keep, buf = _alloc(shard.nbytes, pin)
                slot._keep.append(keep)
                slot._buffers[shard.index] = buf
                self._count(shard.nbytes)
        return slot

    def _count(self, nbytes: int) -> None:
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
            for keep in slot._keep:
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


def copy_entries(buf: torch.Tensor, entries: Iterable[TensorEntry], tensors: list[torch.Tensor | None],
                 streams: Mapping[int, Any] | None = None) -> set[int]:
    """Copy each entry's source tensor into ``buf``. A CUDA source copies asynchronously on the stream of
    its own device in ``streams``; returns those devices (their copies are in flight)."""
    queued: set[int] = set()
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
        dst = entry_view(buf, e)
        if src.is_cuda and streams is not None:
            _copy_async(dst, src, streams[src.device.index])
            queued.add(src.device.index)
        else:
            dst.copy_(src)
    return queued


def _copy_async(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
    """Queue ``src`` -> ``dst`` (pinned host) on ``stream``, which belongs to ``src``'s device."""
    with torch.cuda.device(src.device.index), torch.cuda.stream(stream):
        # The allocator may hand src's memory to another stream once the caller frees it; the copy
        # stream still reads it, so the block is kept until that stream's queued work is done.
        src.record_stream(stream)
        # A conj/neg view would be fixed up by copy_ with conj_physical_()/neg_() on the host
        # destination, on the CPU, while the DMA is still writing it. Resolve on the device instead.
        src = src.resolve_conj().resolve_neg()
        dst.copy_(src, non_blocking=True)
