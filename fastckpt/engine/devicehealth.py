"""Health statistics of CUDA tensors measured on their device, queued with their copies (``health.enabled``).

On the host, the statistics of a staged shard cost an I/O worker a pass of reductions over every byte, with a few
torch calls a piece (format/batchpass.py), each a GIL hand-over the launch-bound training thread pays for. The
device has the values already: the copy thread queues, right after a shard's copies and on the same copy stream
(so they read what the copies read), two fused reductions per dtype over the shard's floating-point sources on
that device, ``torch._foreach_norm(sources, 2, dtype=float64)`` (the L2 norm, squares accumulated in float64) and
``torch._foreach_norm(sources, inf, dtype=float64)`` (the largest absolute value, exact), stacks their answers and
copies those few bytes to pinned host memory, before the shard's "copied" event. The I/O worker that waits for the
event reads them (``finish``): a tensor whose two figures are finite has no NaN and no Inf, so its ``nan``/``inf``
are 0, ``absmax`` the maximum and ``l2`` the norm; its ``fp`` (a fingerprint of 4 KiB of the staged bytes) and
``n`` are taken on the host as before. A tensor whose figures are not finite (a NaN, an Inf, or float64 squares
beyond the range), one of another dtype (integers, bool, complex, float8) and a CPU source are measured on the
host by format/healthpass.py's ``tensor_pass``, value for value as before; the writer takes the CRC32C of the
staged bytes itself.

The figures are those of format/health.py (docs/FORMAT.md, "Health"): ``n``, ``nan``, ``inf``, ``absmax`` and
``fp`` exactly; ``l2`` is the norm of the same values summed in another order (float64 on the device, against
float32 groups of 512 summed in float64 on the host), so the two agree within the documented 1e-6 relative (the
device's is the closer to the exact norm). Only the open layout's shards are measured here: a torch file stages
storages whose values' dtype only its format knows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..format.batchpass import NATIVE
from ..format.healthpass import fingerprints, tensor_pass
from ..format.plan import TensorEntry
from .cudacopy import DeviceBatch

__all__ = ["DeviceStats", "figures", "finish", "queue_stats"]


@dataclass(eq=False, slots=True)
class DeviceStats:
    """One batch's figures on their way to the host: ``host`` (pinned float64) holds the L2 norm of each measured
    entry, then its largest absolute value, in ``positions`` order; valid once the shard's event completed."""

    positions: list[int]
    host: torch.Tensor


def figures(batch: DeviceBatch) -> tuple[list[int], torch.Tensor] | None:
    """The reductions of ``batch``'s floating-point sources, queued on the current stream: the positions measured
    and one float64 tensor on their device holding each one's L2 norm, then each one's largest absolute value; None
    when none is measured here. Norms do not depend on the sign, so a negative view is measured as it is (a complex
    one is not measured here)."""
    by_dtype: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
    for pos, src in zip(batch.positions, batch.sources):
        if src.dtype in NATIVE:
            positions, sources = by_dtype.setdefault(src.dtype, ([], []))
            positions.append(pos)
            sources.append(src)
    if not by_dtype:
        return None
    order: list[int] = []
    norms: list[torch.Tensor] = []
    maxes: list[torch.Tensor] = []
    with torch.no_grad():
        for positions, sources in by_dtype.values():  # one dtype a call: torch's fused route takes one dtype
            order.extend(positions)
            norms.extend(torch._foreach_norm(sources, 2, dtype=torch.float64))
            maxes.extend(torch._foreach_norm(sources, math.inf, dtype=torch.float64))
        return order, torch.stack(norms + maxes)


def queue_stats(batch: DeviceBatch, stream: Any) -> DeviceStats | None:
    """Queue ``figures`` of ``batch`` and the copy of their answers to pinned host memory on ``stream`` (the
    batch's copy stream, right after its copies); None when none of its sources is measured here."""
    with torch.cuda.device(batch.device), torch.cuda.stream(stream):
        got = figures(batch)
        if got is None:
            return None
        order, answers = got
        host = torch.empty(answers.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(answers, non_blocking=True)
    return DeviceStats(order, host)


def finish(stats: Sequence[DeviceStats], buf: torch.Tensor, entries: Sequence[TensorEntry],
           keys: Sequence[str]) -> dict[str, Any]:
    """Called by the I/O worker once the shard's copies (and so its figures) have landed in ``buf``: each of
    ``entries``' statistics by key, from the device's figures where they are finite, else measured on the staged
    bytes here (format/healthpass.py)."""
    figures: dict[int, tuple[float, float]] = {}
    for st in stats:
        vals = st.host.tolist()
        k = len(st.positions)
        for i, pos in enumerate(st.positions):
            figures[pos] = (vals[i], vals[k + i])
    measured = [pos for pos in range(len(entries))
                if all(math.isfinite(v) for v in figures.get(pos, (math.nan, math.nan)))]
    fps = dict(zip(measured, fingerprints(memoryview(buf.numpy()),
                                          [(entries[pos].offset, entries[pos].nbytes) for pos in measured])))
    out: dict[str, Any] = {}
    for pos, e in enumerate(entries):
        if pos in fps:
            l2, top = figures[pos]
            out[keys[e.index]] = {"n": e.nbytes // e.dtype.itemsize, "nan": 0, "inf": 0, "absmax": top, "l2": l2,
                                  "fp": fps[pos]}
        else:  # not measured on the device, or a NaN/Inf/overflow there: value for value, as before
            out[keys[e.index]] = tensor_pass(buf[e.offset:e.offset + e.nbytes], e.dtype)[0]
    return out
