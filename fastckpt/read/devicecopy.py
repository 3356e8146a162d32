"""A load's host-to-device copies: verified host bytes into CUDA targets, on fastckpt's own side stream of each
device, ordered after the caller's current stream there.

Both CUDA paths of ``load_into`` go through ``DeviceCopies``: ``read_into``'s buffered targets (plain tensors, read
into pinned buffers) and the loader's distributed/DTensor path (an FSDP2 resume), whose regions are copied out of
the read buffers on the load worker threads. A plain ``dst.copy_(src)`` there was wrong twice over:

- **order**: it runs on the worker thread's current stream, the legacy default stream, which torch's streams
  (created non-blocking: the caller's own, FSDP's) do not wait for nor make wait. So it was not ordered after what
  the caller had queued on its current stream: a kernel still reading the parameters, or the lazy copy of a save
  still reading them (``Checkpointer.load_into`` waits for those there). ``prepare`` makes each device's side stream
  wait for the caller's current stream, and ``finish`` makes the caller's current stream wait for the side stream;
- **cost**: a copy from pageable memory is synchronous, one legacy-stream synchronization per tensor, each
  serializing with every blocking stream of the device. Here a pageable source is staged into a pinned buffer
  (a host memcpy on the worker) and copied with ``non_blocking=True``; the worker waits once per ``budget`` bytes.

The side streams are dedicated (``fastckpt.cudart.dedicated_stream``), one per device for the life of the process
(``load_stream``), not torch's pool, whose 32 streams per device NCCL and FSDP2 share: a load's copies must not
queue behind a collective, nor a collective behind them. Pinned buffers are held until their copies are done
(``drain``), at most about ``budget`` bytes at a time.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable

import torch

from ..cudart import dedicated_stream

__all__ = ["DeviceCopies", "load_stream", "pinned_copy", "BUDGET"]

BUDGET = 256 << 20  # pinned bytes in flight before a worker waits for the copies: bounds the pinned memory
_streams: dict[int, Any] = {}  # device -> this process's load stream there
_streams_lock = threading.Lock()


def load_stream(device: int) -> Any:
    """This process's load side stream of ``device``: made on first use (``dedicated_stream``), never destroyed (the
    caching allocator keeps using a stream that made a temporary: a strided target's copy makes one)."""
    with _streams_lock:
        if device not in _streams:
            _streams[device] = dedicated_stream(device, 0)
        return _streams[device]


def pinned_copy(src: torch.Tensor) -> torch.Tensor:
    """A page-locked copy of the CPU tensor ``src`` (torch's caching host allocator: recycled once its copies ran)."""
    staged = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    staged.copy_(src)
    return staged


class DeviceCopies:
    """The copies of one load into CUDA targets: ``prepare`` and ``finish`` on the caller's thread, ``copy`` on any
    thread in between, ``drain`` when the sources must be let go (a batch's end, the load's end)."""

    def __init__(self, budget: int = BUDGET, streams: Callable[[int], Any] = load_stream) -> None:
        self.budget = budget
        self._stream_of = streams
        self.streams: dict[int, Any] = {}  # device -> its side stream for this load
        self.held: list[torch.Tensor] = []  # pinned sources whose copies may still run
        self.held_bytes = 0
        self.lock = threading.Lock()

    def prepare(self, devices: Iterable[int]) -> None:
        """Called on the caller's thread before any copy: each device's side stream waits for everything already
        queued on the caller's current stream of that device (``current_stream`` is per thread: taken here, never
        on a worker)."""
        for d in sorted(set(devices)):
            stream = self._stream_of(d)
            stream.wait_stream(torch.cuda.current_stream(d))
            self.streams[d] = stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, pinned: bool = False) -> None:
        """``dst.copy_(src)``: ``src`` a CPU tensor of ``dst``'s shape and dtype. Into a CPU ``dst`` at once; into a
        CUDA one (or a view of one) queued on the side stream of its device (``prepare``d), a source not ``pinned``
        (the caller's word: it allocated it pinned) staged into a pinned buffer first, so that the caller may reuse
        or drop its memory as soon as this returns."""
        if not dst.is_cuda:
            with torch.no_grad():
                dst.copy_(src)
            return
        if not pinned:
            src = pinned_copy(src)
        d = dst.device.index
        stream = self.streams[d]
        nbytes = src.numel() * src.element_size()
        with self.lock:  # queued and held together: a drain() on another thread never drops a source it did not wait for
            with torch.no_grad(), torch.cuda.device(d), torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            self.held.append(src)
            self.held_bytes += nbytes
            over = self.held_bytes > self.budget
        if over:
            self.drain()

    def drain(self) -> None:
        """Block until every copy queued so far is done (a blocking event: the thread sleeps, no core spins), then
        let their sources go."""
        with self.lock:
            done = []
            for d, stream in self.streams.items():
                with torch.cuda.device(d):
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream)
                    done.append((d, event))
            sources, self.held, self.held_bytes = self.held, [], 0
        for d, event in done:
            with torch.cuda.device(d):
                event.synchronize()
        del sources  # after the wait: each was read by a copy recorded before its event

    def finish(self) -> None:
        """Called on the caller's thread: its next kernels on each device run after the loaded values landed."""
        for d, stream in self.streams.items():
            torch.cuda.current_stream(d).wait_stream(stream)
