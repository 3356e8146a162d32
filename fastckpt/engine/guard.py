"""The mutation guard of lazy snapshots: version counters taken in save(), checked at copy time.

A lazily copied tensor is read by the copy thread after ``save()`` has returned. That
is safe only if nothing changes it before the optimizer's step (which waits for
staging). Code that changes a watched tensor elsewhere (an EMA swap, ``clamp_`` in a
callback, weight surgery) would make the checkpoint hold values from after ``save()``.

Each in-place op through the tensor or any alias sharing its version counter (the
``state_dict()`` detached alias, views) bumps ``tensor._version``, so a counter that
moved between ``save()`` and the copy proves a change. The guard cannot see writes
that skip the counter: through ``.data``, fused optimizer kernels, numpy/DLPack views,
other processes; on CUDA, kernels enqueued after the copy was enqueued.

The counter moves only once an in-place kernel has written, so a copy that reads a tensor while a kernel is
writing it passes both of that tensor's checks when the kernel ends after the second. Every lazy tensor is
therefore checked once more when the whole snapshot is staged (``check_all``), just before ``wait_staged()``
lets the optimizer step: by then a write that raced a copy has bumped its counter, unless it is still running
at that very moment (a window of one kernel, against the whole staging time before). That window is closed by
the seal (fastckpt/engine/seal.py): on the training thread, before the commit, every counter is read once more
(``moved``), and sampled bytes catch the writes that skip the counter.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ..errors import SnapshotMutatedError
from ..format.plan import TensorEntry

__all__ = ["LazyOrder", "VersionGuard"]


_VERSION = operator.attrgetter("_version")


def _version(t: torch.Tensor) -> int | None:
    # Inference tensors have no version counter (and cannot be changed outside inference mode). Asked by trying,
    # not by ``is_inference()``: a torch call per tensor hands the GIL over, reading the counter does not.
    try:
        return t._version
    except RuntimeError:
        return None


class LazyOrder:
    """The lazy entries of a plan's shards in the order the copy thread copies them, their table indices, each
    index's position, and a C-level gather of their sources: made once per plan (``of``), shared by every save of
    it (the guard and the seal read the sources in this order)."""

    __slots__ = ("entries", "indices", "pos", "pick")

    def __init__(self, entries: list[TensorEntry]) -> None:
        self.entries = entries
        self.indices = [e.index for e in entries]
        self.pos = {i: k for k, i in enumerate(self.indices)}
        get = operator.itemgetter(*self.indices) if len(self.indices) > 1 else None
        self.pick: Callable[[Sequence[Any]], list[Any]] = (
            (lambda xs: list(get(xs))) if get is not None else (lambda xs: [xs[i] for i in self.indices]))

    @staticmethod
    def of(memo: dict[Any, Any] | None, shards: Sequence[Any]) -> LazyOrder:
        """The ``LazyOrder`` of ``shards`` (a plan's lazy shards), from ``memo`` (the plan's) where made before."""
        key = ("lazy", tuple(s.index for s in shards))
        got = memo.get(key) if memo is not None else None
        if got is None:
            got = LazyOrder([e for s in shards for e in s.entries])
            if memo is not None:
                memo[key] = got
        return got


class VersionGuard:
    """Version counters of one save's lazy tensors. Built by ``save()``; checked by the copy thread."""

    def __init__(self, name: str, tensors: Sequence[torch.Tensor], keys: Sequence[str],
                 entries: Iterable[TensorEntry] | LazyOrder) -> None:
        self._name = name
        self._keys = keys
        self._order = entries if isinstance(entries, LazyOrder) else LazyOrder(list(entries))
        # Its own references: the copy loop drops a source from the save's list once its copy is queued, and
        # check_all() reads every counter after that (the optimizer owns these tensors: they stay alive anyway).
        # Gathered and read in C-level calls (inside save(), on the training thread): no Python call per tensor.
        self._sources: list[torch.Tensor] = self._order.pick(tensors)
        try:
            self._seen: list[int | None] = list(map(_VERSION, self._sources))
        except RuntimeError:  # an inference tensor among them: no counter, asked one by one
            self._seen = list(map(_version, self._sources))
        self._counted = None not in self._seen  # every one has a counter: compared in one map

    def around(self, entries: Iterable[TensorEntry]) -> Iterator[TensorEntry]:
        """``entries`` for the copy loop, each checked right before it is handed out and right after.

        The copy loop asks for the next entry only once it has copied (on CUDA: queued) the current
        one, so the second check runs after that copy, with no change to the copy code itself."""
        for e in entries:
            self.check(e.index)
            yield e
            self.check(e.index)

    def let_go(self) -> None:
        """Called once the snapshot is sealed: no check is made any more; the tensors are dropped by the caller's
        thread (engine/sealing.py says why)."""
        self._sources = []
        self._seen = []

    def check_all(self) -> None:
        """Called by the copy thread once every lazy copy is done, before ``wait_staged()`` returns: raise
        ``SnapshotMutatedError`` if any lazy tensor changed since ``save()``, however late its counter moved."""
        if self._counted and list(map(_VERSION, self._sources)) == self._seen:
            return
        for index in self._order.indices:
            self.check(index)

    def moved(self) -> list[int]:
        """The indices of the lazy tensors whose counter moved since ``save()`` (the seal's check, on the
        training thread: no in-place kernel of its own is still running there, so none is missed)."""
        sources, seen = self._sources, self._seen
        if self._counted and list(map(_VERSION, sources)) == seen:
            return []
        return [i for i, t, then in zip(self._order.indices, sources, seen) if then is not None and t._version != then]

    def check(self, index: int) -> None:
        """Raise ``SnapshotMutatedError`` if tensor ``index`` changed in place since ``save()``."""
        sources, seen = self._sources, self._seen  # let_go() may empty them meanwhile (the seal's thread)
        k = self._order.pos.get(index)
        if k is None or k >= len(sources) or k >= len(seen) or seen[k] is None:
            return
        then = seen[k]
        now = sources[k]._version
        if now != then:
            raise SnapshotMutatedError(
                f"checkpoint {self._name!r}: tensor {self._keys[index]!r} was changed in place after save() "
                f"returned and before the background copy finished reading it (its version counter moved from "
                f"{then} to {now}), so this checkpoint would hold values from after save(); it was discarded and "
                "the previous checkpoint is intact. Watched parameters and optimizer state may change only in "
                "optimizer.step(): for code that changes them elsewhere (EMA swaps, clamping, weight surgery in "
                "a callback) set `staging.mode: eager`, or call Checkpointer.wait_staged() before the change. If "
                "optimizer.step() changed it, the step did not wait: use watch(optimizer) (hook=True) or call "
                "wait_staged() before step()")
