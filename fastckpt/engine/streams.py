"""CUDA streams and events of the device-to-host copies, kept per device.

A CUDA stream and an event belong to one device, and a kernel queued on a stream of
another device is not ordered with them. So everything here is keyed by device index:
each device whose tensors a save copies gets its own copy streams, its own ready event
(recorded on that device's current stream when ``save()`` is called) and its own
"copied" event per shard. Waits are queued on the current stream *of the event's
device*, never on the calling thread's current device.

The copy streams are fastckpt's own (``fastckpt.cudart.dedicated_stream``: ``cudaStreamCreateWithPriority``
through torch's own runtime, wrapped in ``torch.cuda.ExternalStream``), not torch's pool:
``torch.cuda.Stream()`` hands out the same 32 streams per priority to every caller, NCCL's and FSDP2's
side streams included, so a copy could queue behind (or delay) a collective. They are made once per device and
priority in a process and never destroyed: the caching allocator keeps using a stream
after any ``close()`` (``record_stream`` on a parameter records an event on it when the
parameter is freed; a temporary made on it for a strided source stays cached in its pool,
and expandable segments synchronize it when released), and doing so on a destroyed stream
is a CUDA error. Where torch's runtime cannot be called (a statically linked one), the
copies fall back to a pool stream, logged once.

Nothing here runs without a CUDA tensor in the state: on CPU-only machines the
``CudaCopy`` of a job is ``None`` and these functions are never called.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..cudart import dedicated_stream

__all__ = ["CopyStreams", "CudaCopy", "StreamFactory", "cuda_devices", "dedicated_stream", "gpu_wait", "host_wait",
           "pending", "process_stream", "record_done", "shard_events", "snapshotted"]

log = logging.getLogger("fastckpt")

StreamFactory = Callable[[int, int], Any]  # (device, priority) -> a stream of that device
_made: dict[tuple[int, int], Any] = {}  # (device, priority) -> this process's copy stream (process_stream)
_made_lock = threading.Lock()

# One copy's "done" event: ``blocking`` makes ``synchronize()`` sleep in the driver instead
# of spinning a core (an I/O worker may wait on it for the whole copy).
_DONE_FLAGS = {"blocking": True}
# Lower is higher. torch maps a priority past the device's range to the nearest valid one, so this
# is the highest the device offers (torch.cuda.Stream's documented clamping).
_HIGHEST_PRIORITY = -64


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[int]:
    """The CUDA device indices ``tensors`` live on, sorted (empty on a CPU-only state)."""
    return sorted({t.device.index for t in tensors if t.is_cuda})


class CopyStreams:
    """One stream for lazy copies and one high-priority stream for eager copies, per device.

    Owned by a ``Checkpointer``; the streams are the process's (``process_stream``: made on first use, on their
    own device, shared by every ``Checkpointer``, never destroyed). Eager
    copies (inside ``save()``) get their own stream so they never queue behind the previous
    save's lazy copies, and a high priority so the training stream does not starve them.
    """

    def __init__(self, factory: StreamFactory | None = None, snapshots: Any = None) -> None:
        """``factory``: the stream of a device with a priority (default ``process_stream``); ``snapshots``:
        ``staging.device_snapshot``'s ``DeviceSnapshots`` (engine/devicesnap.py), None for never."""
        self._factory = factory or process_stream
        self._lazy: dict[int, Any] = {}
        self._eager: dict[int, Any] = {}
        self.snapshots = snapshots

    def lazy(self, device: int) -> Any:
        """Called by ``save()``: the lazy copy stream of ``device``."""
        if device not in self._lazy:
            self._lazy[device] = self._factory(device, 0)
        return self._lazy[device]

    def eager(self, device: int) -> Any:
        """Called by ``save()``: the eager copy stream of ``device`` (lower number = higher priority)."""
        if device not in self._eager:
            self._eager[device] = self._factory(device, _HIGHEST_PRIORITY)
        return self._eager[device]

    def prepare(self, devices: list[int], tensors: list[Any] | None = None) -> "CudaCopy":
        """Called by ``save()`` on the training thread: a job's streams and ready events, and with ``snapshots``
        the copy of ``tensors`` (the state's) on their devices, taken first (``CudaCopy.snapshot``).

        Each ready event marks where ``save()`` was called on that device's current stream:
        the copies of that device wait for it (the state they read, or its device copy, is computed by then).
        """
        snapshot = None if self.snapshots is None or tensors is None else self.snapshots.take(tensors, devices)
        ready = {}
        for d in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(d))
            ready[d] = ev
        job = CudaCopy(devices=devices, ready=ready, eager={d: self.eager(d) for d in devices},
                       lazy={d: self.lazy(d) for d in devices}, snapshot=snapshot,
                       snapshots=self.snapshots if snapshot is not None else None)
        for d in devices:
            job.eager[d].wait_event(ready[d])  # host-side non-blocking
        return job


def process_stream(device: int, priority: int) -> Any:
    """This process's copy stream of ``device`` and ``priority`` (``dedicated_stream``), made on first use and shared
    by every ``Checkpointer``: a few streams for the life of the process, never destroyed (see the module's doc)."""
    with _made_lock:
        if (device, priority) not in _made:
            _made[(device, priority)] = dedicated_stream(device, priority)
        return _made[(device, priority)]


@dataclass(eq=False)
class CudaCopy:
    """One save's CUDA bookkeeping: made by ``save()``, read by the copy thread."""

    devices: list[int]
    ready: dict[int, Any]
    eager: dict[int, Any]
    lazy: dict[int, Any]
    lazy_waited: bool = False
    # staging.device_snapshot: the state's tensors with the CUDA ones replaced by their copy on the device (the copies
    # to the host read these), and the DeviceSnapshots that made them; None: the live tensors are read
    snapshot: list[Any] | None = None
    snapshots: Any = None
    # (shard, device) -> the sources its copies read, kept until they are seen done (engine/cudacopy.py)
    kept: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    # (shard, device) -> its tensors' health figures measured on the device (engine/devicehealth.py)
    stats: dict[tuple[int, int], Any] = field(default_factory=dict)

    def begin_lazy(self) -> None:
        """Called by the copy thread before its first lazy copy of this job."""
        # Like DataLoader's pin-memory thread: a thread whose current device is unset would
        # open a stray context on GPU 0 at its first CUDA call.
        torch.cuda.set_device(self.devices[0])
        if not self.lazy_waited:
            for d in self.devices:
                self.lazy[d].wait_event(self.ready[d])
            self.lazy_waited = True


def snapshotted(job: Any) -> bool:
    """Whether ``job`` (engine/pipeline.py's) copies a device snapshot: no stream of the caller's waits for those
    copies, and no seal checks its sources (engine/devicesnap.py)."""
    return job.cuda is not None and job.cuda.snapshot is not None


def record_done(stream: Any) -> Any:
    """A blocking event recorded on ``stream``: set once every copy queued there so far is done."""
    ev = torch.cuda.Event(**_DONE_FLAGS)
    ev.record(stream)
    return ev


def shard_events(events: dict[tuple[int, int], Any], shard: int) -> list[tuple[int, Any]]:
    """``(device, event)`` pairs of one shard, from a job's ``(shard, device) -> event`` table."""
    return [(d, ev) for (s, d), ev in list(events.items()) if s == shard]


def host_wait(pairs: Iterable[tuple[int, Any]]) -> None:
    """Block this thread until each event completed (under its own device, so no stray context)."""
    for d, ev in pairs:
        with torch.cuda.device(d):
            ev.synchronize()


def gpu_wait(pairs: Iterable[tuple[int, Any]]) -> None:
    """Make work queued next on each event's device's current stream wait for it (host does not block)."""
    for d, ev in pairs:
        torch.cuda.current_stream(d).wait_event(ev)


def pending(pairs: Iterable[tuple[int, Any]]) -> list[tuple[int, Any]]:
    """The pairs whose event has not completed: completed ones need no further wait."""
    left = []
    for d, ev in pairs:
        with torch.cuda.device(d):
            if not ev.query():
                left.append((d, ev))
    return left
