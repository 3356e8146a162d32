"""The three ways the background stages, checksums and measures a CPU shard, for tests that must hold on each.

``compiled``: format/fused.py, one compiled call a shard (numba; the warm-up is awaited here, and its failure fails
the test: numba is one of fastckpt's dependencies).
``batched``: format/batchpass.py, a few torch calls a piece, on threads whose torch reductions run serially
(engine/serialops.py: every fastckpt thread where torch's OpenMP runtime is found). ``blocked``: the block-by-block
pass (format/healthpass.py, engine/onepass.py's ``copy_with_*``, staging's ``copy_entries``), what a thread that
cannot be made serial runs. ``use(monkeypatch, path)`` forces one; ``around_fill`` places a "concurrent" write
deterministically around the batched copy of a piece (the compiled pass: around its one call), as the entry
iterators of the blocked copies allow.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

import fastckpt.engine.onepass as onepass
import fastckpt.format.batchpass as batchpass
import fastckpt.format.fused as fused
import fastckpt.format.healthpass as healthpass

PATHS = ["compiled", "batched", "blocked"]
# the real functions, so that a second ``measuring_threads`` in one test does not wrap the first one's wrappers
_REAL = {m: m.tensor_pass for m in (healthpass, onepass, batchpass)}
_MEASURE = batchpass.measure
_STATS = fused._stats


def use(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Make the background take ``path``: ``blocked`` tells the engine its threads are not serial."""
    assert path in PATHS, path
    if path == "compiled":
        assert fused.warm("on").result(timeout=600) is not None, fused.state()
        return
    monkeypatch.setattr(fused, "kernel", lambda mode, nbytes: None)  # a kernel warmed by another test stays unused
    if path == "blocked":
        monkeypatch.setattr(onepass, "is_serial", lambda: False)


def around_fill(monkeypatch: pytest.MonkeyPatch, before: Callable[[list[torch.Tensor]], None],
                after: Callable[[list[torch.Tensor]], None]) -> None:
    """Call ``before(sources)`` right before, ``after(sources)`` right after each batched copy of a piece (the
    sources of its parts): after the mutation guard's check before the copy, before its check after it."""
    real = onepass.batch_filler

    def filler(lay: Any, tensors: list[torch.Tensor | None]) -> Callable[[Any], None]:
        fill = real(lay, tensors)

        def each(parts: Any) -> None:
            sources = [tensors[lay.entries[p.pos].index] for p in parts]
            before(sources)  # type: ignore[arg-type]
            fill(parts)
            after(sources)  # type: ignore[arg-type]
        return each

    monkeypatch.setattr(onepass, "batch_filler", filler)
    real_run = fused.run

    def run(k: Any, lay: Any, *, tensors: Any, health: bool, **kw: Any) -> Any:
        if tensors is None:
            return real_run(k, lay, tensors=tensors, health=health, **kw)
        sources = [tensors[e.index] for e in lay.entries]
        before(sources)
        try:
            return real_run(k, lay, tensors=tensors, health=health, **kw)
        finally:
            after(sources)

    monkeypatch.setattr(fused, "run", run)


def measuring_threads(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The kinds of the threads that measure health statistics (either path), filled as they do."""
    threads: set[str] = set()

    def seen(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            threads.add("-".join(threading.current_thread().name.split("-")[:2]))
            return real(*args, **kwargs)
        return call

    for module, real in _REAL.items():
        monkeypatch.setattr(module, "tensor_pass", seen(real))
    monkeypatch.setattr(batchpass, "measure", seen(_MEASURE))
    monkeypatch.setattr(fused, "_stats", seen(_STATS))
    return threads
