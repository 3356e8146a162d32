"""A shard's device-to-host copies, queued in a handful of torch calls whatever its tensor count.

The copy of each CUDA tensor used to cost about ten torch calls on the copy thread (a device guard, a stream
context, ``record_stream``, ``resolve_conj``/``resolve_neg``, ``copy_``, ...), and each call hands the GIL over: the
training thread, which launches the kernels and holds the GIL nearly all the time, waits at each hand-over for the
copy thread's Python (a launch-bound H200 run stalled 113 ms a checkpoint of 1.96 GB; ``python -m
benchmarks.gilcalls --cuda`` counts the hand-overs). Here the sources of one shard are copied by one
``torch._foreach_copy_(views, sources, non_blocking=True)`` per device, on that device's copy stream. Torch's CUDA
kernel of ``_foreach_copy_`` takes its fused route only for tensors of one device; a CPU destination sends it to
its per-tensor loop, ``views[i].copy_(sources[i], non_blocking=True)`` in C++: exactly the copies queued before,
one hand-over for all of them. Each ``copy_`` of a CUDA source selects the source's device and queues a
``cudaMemcpyAsync`` on that device's *current* stream, the copy stream inside ``torch.cuda.stream``; a strided
source is first made contiguous on that same stream (torch's ``copy_`` does it, in the copy stream's memory pool).

Conjugate and negative views: torch's ``copy_`` into a host tensor fixes the bits up afterwards with
``conj_physical_()``/``neg_()`` on the CPU, over the destination that the DMA may still be writing. So such a
source is resolved on the device first, on the copy stream (``resolve_conj().resolve_neg()``); which sources need
it is read from their dispatch key sets, under the GIL (``Tensor.is_conj()``/``is_neg()`` hand it over per call).

The caching allocator: the copy stream reads a source after ``save()`` returned, and a source the caller frees
meanwhile (a temporary of its state dict) would go back to its pool at once, to be handed to the next allocation
on the stream it was made on while the copy still reads it. ``record_stream`` per source prevented that, one
hand-over each. Instead the copier keeps the sources (``DeviceBatch.sources``, in ``Job.kept``) until the shard's
copies are seen done (the I/O worker's wait on their event, or the committer's on a failure): dropped then, a freed
source's memory is reused only after its copy. Dropping a reference the caller also holds costs nothing; only the
last reference frees, and that is the rare temporary. The resolved copies of conjugate views and the contiguous
temporaries are made on the copy stream itself, where the allocator orders their reuse after the copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..format.plan import TensorEntry

__all__ = ["DeviceBatch", "device_batches", "has_lazy_bits", "queue_copies", "resolved"]

# Tensor.is_conj() and is_neg() are torch calls that release the GIL; the dispatch key set is read under it. Where
# this torch lacks the private accessor, the two calls are made.
_KEYS: Callable[[torch.Tensor], Any] | None = getattr(torch._C, "_dispatch_keys", None)
_CONJ = getattr(getattr(torch._C, "DispatchKey", None), "Conjugate", None)
_NEG = getattr(getattr(torch._C, "DispatchKey", None), "Negative", None)


def has_lazy_bits(t: torch.Tensor) -> bool:
    """Whether ``t`` is a conjugate or negative view (its memory is not its values), without a GIL hand-over."""
    if _KEYS is None or _CONJ is None or _NEG is None:
        return t.is_conj() or t.is_neg()
    keys = _KEYS(t)
    return keys.has(_CONJ) or keys.has(_NEG)


def resolved(sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``sources`` with each conjugate or negative view resolved, on the current stream (the others as they are)."""
    return [s.resolve_conj().resolve_neg() if has_lazy_bits(s) else s for s in sources]


@dataclass(eq=False, slots=True)
class DeviceBatch:
    """The CUDA sources of one shard that live on ``device``, with their entries' positions in the shard."""

    device: int
    positions: list[int] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)


def device_batches(entries: Sequence[TensorEntry], tensors: Sequence[torch.Tensor | None]
                   ) -> tuple[list[DeviceBatch], list[TensorEntry]]:
    """``entries``' non-empty CUDA sources (``tensors[entry.index]``) by device, and the entries whose source is on
    the CPU (copied by the caller). Python attribute reads only: no torch call per tensor."""
    by_device: dict[int, DeviceBatch] = {}
    on_cpu: list[TensorEntry] = []
    for pos, e in enumerate(entries):
        if e.nbytes == 0:
            continue
        src = tensors[e.index]
        if src is None:
            raise ValueError(f"staging layout mismatch for tensor #{e.index}: its source was already dropped")
        if not src.is_cuda:
            on_cpu.append(e)
            continue
        device = src.get_device()
        batch = by_device.get(device)
        if batch is None:
            batch = by_device[device] = DeviceBatch(device)
        batch.positions.append(pos)
        batch.sources.append(src)
    return list(by_device.values()), on_cpu


def queue_copies(views: Sequence[torch.Tensor], batch: DeviceBatch, stream: Any) -> None:
    """Queue the copy of each of ``batch``'s sources into its staged destination (``views[position]``, pinned host
    memory) on ``stream`` (the batch's device's copy stream): one ``torch._foreach_copy_``."""
    dsts = [views[pos] for pos in batch.positions]
    # The device first (a thread whose current device is another would open a context there), then its copy stream
    # as the current one: every copy_ below queues on it. No autograd graph: the views are plain buffers.
    with torch.cuda.device(batch.device), torch.cuda.stream(stream), torch.no_grad():
        torch._foreach_copy_(dsts, resolved(batch.sources), non_blocking=True)
