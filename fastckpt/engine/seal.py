"""The seal of a lazy snapshot: on the training thread, before the commit, prove the sources did not move.

A lazy snapshot is committed only once sealed, at the first of: the watched optimizer's step pre-hook
(``wait_staged``), ``wait()``, ``close()``, the next ``save()``. By then staging is complete, and on the CPU every
in-place kernel the training thread launched has returned, so (i) a version counter that moved since ``save()``
proves a write, however late it was bumped (the copy thread's own checks leave a window of one kernel). On CUDA a
kernel queued before the seal may still be running: its counter has moved already (the bump happens at launch
on the host), and the gather of (ii) below is queued behind it on the current stream, so it still sees it.

(ii) Writes that skip the counter (``.data``, numpy or DLPack views, fused kernels) are caught by sampling a few
bytes of every 4 KiB page of each lazy tensor (whole tensors up to ``WHOLE`` bytes), at an offset drawn per save:
inside ``save()`` from the sources (on CUDA a small gather left on the device), by the copy thread from the staged
bytes right after each copy, and at the seal from the sources again. Staged bytes that differ from save()'s prove
the copy read a later write; sources that differ prove a write since (undone or not). The staged buffers
themselves need not stay alive (ring mode reuses them, and holding them until the seal would stall the ring). A sparse write into a large tensor
through ``.data`` can fall between the samples: the sample makes such writes likely to be caught, not certain.
"""
from __future__ import annotations

import random
from typing import Iterable, Sequence

import torch

from ..format.plan import TensorEntry
from .guard import VersionGuard

__all__ = ["Seal", "PAGE", "WHOLE"]

PAGE = 4096  # one sample run per page
RUN = 8  # bytes per sample run
WHOLE = 64 * 1024  # tensors up to this size are compared whole
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


class Seal:
    """One lazy snapshot's seal: the version guard plus sampled bytes of each lazy tensor."""

    def __init__(self, guard: VersionGuard, tensors: Sequence[torch.Tensor | None], keys: Sequence[str],
                 entries: Iterable[TensorEntry]) -> None:
        """Called inside ``save()``, on the training thread: the sampled bytes of the moment of the snapshot."""
        self.guard = guard
        self._keys = keys
        self._shift = _RNG.randrange(PAGE - RUN)  # per save: a writer cannot learn which bytes are compared
        self._index: dict[int, torch.Tensor] = {}
        self._sources: dict[int, torch.Tensor] = {}
        self._at_save: dict[int, torch.Tensor] = {}
        for e in entries:
            src = tensors[e.index]
            raw = None if src is None or not e.nbytes else _bytes(src)
            if raw is None or raw.numel() != e.nbytes:
                continue
            self._sources[e.index] = src  # its own reference: the copy loop drops the save's one
            # on CUDA a small gather queued on the current stream, kept on the device: no sync inside save()
            self._at_save[e.index] = self._sample(raw)
        self._staged: dict[int, torch.Tensor] = {}

    def _sample(self, raw: torch.Tensor) -> torch.Tensor:
        idx = self._offsets(raw.numel())
        return raw.clone() if idx is None else raw[idx.to(raw.device)]

    def _offsets(self, nbytes: int) -> torch.Tensor | None:
        if nbytes <= WHOLE:
            return None  # whole
        got = self._index.get(nbytes)
        if got is None:
            base = torch.arange(0, nbytes, PAGE) + self._shift
            got = (base[:, None] + torch.arange(RUN)).reshape(-1).clamp_(max=nbytes - 1)
            self._index[nbytes] = got
        return got

    def record(self, buf: torch.Tensor, entries: Iterable[TensorEntry]) -> None:
        """Called by the copy thread once ``entries`` are copied into ``buf`` (on CUDA: once the copies landed)."""
        for e in entries:
            if e.index in self._sources:
                self._staged[e.index] = self._sample(buf[e.offset:e.offset + e.nbytes])

    def moved(self) -> list[str]:
        """Called on the training thread at the seal: the keys of the lazy tensors whose counter moved, or whose
        sampled bytes, as copied or as they are now, differ from those of ``save()``."""
        keys = [self._keys[i] for i in self.guard.moved()]
        for index, then in self._at_save.items():
            key = self._keys[index]
            if key in keys:
                continue
            raw = _bytes(self._sources[index])
            now = None if raw is None else self._sample(raw)  # None: no longer a plain tensor (set_/resize)
            staged = self._staged.get(index)
            # CUDA: one device comparison, one device-to-host copy of its answer
            if now is None or now.shape != then.shape or not torch.equal(now, then) or (
                    staged is not None and not torch.equal(staged, then.cpu())):
                keys.append(key)
        return keys
