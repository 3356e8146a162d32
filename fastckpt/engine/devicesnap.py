"""``staging.device_snapshot``: a copy of the state on its own device, taken inside ``save()``, staged to the host
from there over the next steps.

Without it the device-to-host copies read the live tensors, so the next optimizer step must wait (on the GPU) until
they are done: 1.96 GB over PCIe is about 40 ms on an idle H200, longer while training runs. With it ``save()``
queues one device-to-device ``torch._foreach_copy_`` per device and dtype on the caller's current stream (about
1 ms for 2 GB on an H100), into a buffer of this module's that nothing else writes; the copies to the host read that
buffer, so no stream of the caller's waits for them, and the snapshot holds exactly the values at ``save()`` in
stream order (the caller's later kernels are queued behind the device copy on the same stream): there is nothing
for the mutation guard or the seal to check.

The buffer is made at the first save that takes a snapshot and reused by every later one (views cached while the
state's structure is the same). A save whose previous snapshot is still being read (its copies not all queued yet)
stages from the live tensors instead, as without a snapshot; one whose previous snapshot's copies are queued but
still running orders its device copy after them on the GPU (the host does not wait).

``auto`` takes a snapshot while the device's free memory (``torch.cuda.mem_get_info``: memory that not even torch's
caching allocator holds, so the training's peak so far is not counted as free) exceeds what the buffer still needs by
``margin`` (the larger of 1 GiB and a tenth of the device's memory); at a save where it no longer does, the buffer is
given back to torch's allocator and the save stages from the live tensors. ``on`` takes one whenever the buffer can be
allocated. Either way an allocation that fails (``torch.cuda.OutOfMemoryError``) is caught, said once, and the save
goes on without a snapshot: a snapshot never makes a save fail. A buffer as large is not asked for again (each refusal
makes torch's allocator free its cached blocks and retry); a smaller state's is. ``SaveStats.device_snapshot`` says which way a save
went.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from .cudacopy import resolved
from .streams import gpu_wait, pending

__all__ = ["DeviceSnapshots", "MODES", "ALIGN", "fits"]

log = logging.getLogger("fastckpt")

MODES = ("auto", "on", "off")
ALIGN = 512  # bytes: each tensor's copy starts on such a boundary (a fused copy's vector loads need 16)
_GIB = 1 << 30
MemInfo = Callable[[int], tuple[int, int]]  # device -> (free, total) bytes: torch.cuda.mem_get_info


def margin(total: int) -> int:
    """The free memory ``auto`` leaves the device beside a snapshot: the larger of 1 GiB and a tenth of it."""
    return max(_GIB, total // 10)


def fits(mode: str, need: int, free: int, total: int) -> bool:
    """Whether a snapshot buffer still needing ``need`` bytes (0 when made already) may be used on a device with
    ``free`` of ``total`` bytes free: ``on`` always (the allocation may still fail), ``auto`` with ``margin`` left."""
    if mode == "on":
        return True
    return mode == "auto" and free - need >= margin(total)


@dataclass(eq=False)
class _Buffer:
    """One device's snapshot memory and the views of the structure it was last laid out for."""

    device: int
    data: torch.Tensor  # flat uint8 on the device
    key: tuple = ()
    views: list[torch.Tensor] = field(default_factory=list)


class DeviceSnapshots:
    """Owned by a ``Saver``; called on the training thread only (``take``, ``used_by``)."""

    def __init__(self, mode: str, mem_info: MemInfo | None = None) -> None:
        self.mode = mode
        self._mem_info = mem_info or torch.cuda.mem_get_info
        self._buffers: dict[int, _Buffer] = {}
        self._last: Any = None  # the job that read the buffers last (engine/pipeline.py's Job)
        # device -> the size an allocation was refused at: not asked again for as much (each refusal makes torch's
        # allocator free its cached blocks and retry, a cost for the training that uses them)
        self._refused: dict[int, int] = {}
        self._said: set[str] = set()

    def take(self, tensors: Sequence[torch.Tensor | None], devices: Sequence[int]) -> list[torch.Tensor | None] | None:
        """Called by ``save()`` before it records its ready events: ``tensors`` with every CUDA tensor replaced by
        its copy in this module's buffer of its device, the copies queued on each device's current stream; None
        where no snapshot is taken (``off``; no room; the previous snapshot still in use; an allocation refused)."""
        if self.mode == "off" or not devices:
            return None
        last = self._last
        if last is not None and not last.handle.staged():
            self._say("busy", "a save came before the previous snapshot's copies were all queued: it stages from the "
                      "live tensors (staging.device_snapshot)")
            return None
        layout = _layout(tensors)
        buffers: dict[int, _Buffer] = {}
        for d in devices:
            buf = self._buffer(d, layout.get(d, ([], 0))[1])
            if buf is None:
                return None
            buffers[d] = buf
        if last is not None:  # its copies read these buffers: the device copy below queues behind those still running
            gpu_wait(pending([(d, ev) for (_, d), ev in last.shard_events.items()]))
        out = list(tensors)
        for d, buf in buffers.items():
            entries, _ = layout.get(d, ([], 0))
            key = tuple((i, t.dtype, t.shape) for i, t, _ in entries)
            if buf.key != key:
                buf.views = [_view(buf.data, at, t) for _, t, at in entries]
                buf.key = key
            groups: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for (i, t, _), view in zip(entries, buf.views):
                dsts, srcs = groups.setdefault(t.dtype, ([], []))
                dsts.append(view)
                srcs.append(t)
                out[i] = view
            with torch.cuda.device(d), torch.no_grad():  # on d's current stream: the caller's next kernels follow it
                for dsts, srcs in groups.values():  # one dtype a call: torch's fused copy takes one dtype
                    torch._foreach_copy_(dsts, resolved(srcs))
        return out

    def used_by(self, job: Any) -> None:
        """Called by ``save()`` once ``job`` reads the buffers ``take`` filled: the next ``take`` waits for it."""
        self._last = job

    def _buffer(self, device: int, need: int) -> _Buffer | None:
        """``device``'s buffer of at least ``need`` bytes (grown or made now), or None (no room, refused)."""
        buf = self._buffers.get(device)
        have = buf.data.numel() if buf is not None else 0
        if self.mode == "auto":
            free, total = self._mem_info(device)
            if not fits(self.mode, max(0, need - have), free, total):
                if buf is not None:  # the training needs the memory now: given back to torch's allocator
                    del self._buffers[device]
                self._say("room", f"cuda:{device} has {free >> 20} MiB free of {total >> 20} MiB, too little for a "
                          f"snapshot of {need >> 20} MiB beside a margin of {margin(total) >> 20} MiB: saves stage "
                          "from the live tensors (staging.device_snapshot: auto)")
                return None
        if buf is not None and have >= need:
            return buf
        if need >= self._refused.get(device, need + 1):
            return None
        if buf is not None:
            del self._buffers[device]  # freed before the larger one is made: both need not fit at once
            buf = None
        try:
            with torch.cuda.device(device):
                data = torch.empty(max(need, 1), dtype=torch.uint8, device=f"cuda:{device}")
        except torch.cuda.OutOfMemoryError as e:
            self._refused[device] = need
            self._say("oom", f"no snapshot of {need >> 20} MiB on cuda:{device} ({e}): saves stage from the live "
                      "tensors, and a snapshot this large is not tried again (staging.device_snapshot)")
            return None
        buf = self._buffers[device] = _Buffer(device, data)
        return buf

    def _say(self, why: str, message: str) -> None:
        if why not in self._said:  # once per reason and Checkpointer
            self._said.add(why)
            log.warning("fastckpt: %s", message)

    def close(self) -> None:
        """Called by ``Checkpointer.close``: the buffers go back to torch's allocator."""
        self._buffers.clear()
        self._last = None


def _layout(tensors: Sequence[torch.Tensor | None]) -> dict[int, tuple[list[tuple[int, torch.Tensor, int]], int]]:
    """Per device: each CUDA tensor (index, tensor, offset in the buffer) and the bytes the buffer needs."""
    out: dict[int, tuple[list[tuple[int, torch.Tensor, int]], int]] = {}
    for i, t in enumerate(tensors):
        if t is None or not t.is_cuda:
            continue
        d = t.get_device()
        entries, size = out.get(d, ([], 0))
        entries.append((i, t, size))
        nbytes = t.numel() * t.element_size()
        out[d] = (entries, size + -(-nbytes // ALIGN) * ALIGN)
    return out


def _view(data: torch.Tensor, at: int, like: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor of ``like``'s dtype and shape at byte ``at`` of ``data``."""
    nbytes = like.numel() * like.element_size()
    return data[at:at + nbytes].view(like.dtype).view(like.shape)
