"""Stale-save detection: a checkpoint whose parameters did not change although the optimizer stepped.

Async checkpointing can silently write stale weights: the state handed to ``save()`` is a copy made once, or a
reference the optimizer no longer updates (NeMo-RL #3312). ``StaleWatch`` counts the ``step()`` calls of every
watched optimizer (a post-hook) and, on the committer, compares each checkpoint's parameter fingerprints
(format/health.py, measured by the I/O workers) with the previous checkpoint's. Bit-identical parameters across
at least one optimizer step are reported once per ``Checkpointer`` as ``StaleCheckpointWarning``.
"""
from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from ..errors import StaleCheckpointWarning
from ..format.health import fingerprints

__all__ = ["StaleWatch", "Hooks"]

log = logging.getLogger("fastckpt")


@dataclass(frozen=True)
class StaleMark:
    """Taken in ``save()`` on the training thread: the optimizer steps so far, and which keys are parameters."""

    steps: int
    params: frozenset[str]


class Hooks:
    """Several hook handles removed as one (a watched optimizer's pre-hook and step counter)."""

    def __init__(self, *handles: Any) -> None:
        self._handles = [h for h in handles if h is not None]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class StaleWatch:
    """Counts optimizer steps and compares consecutive checkpoints' parameter fingerprints."""

    def __init__(self, measure: bool, warn: bool) -> None:
        self.measure = measure  # health.enabled: the I/O workers measure every tensor
        self.warn = warn and measure  # without fingerprints there is nothing to compare
        self.steps = 0
        self._lock = threading.Lock()
        self._previous: tuple[int, dict[str, str]] | None = None  # the last commit's (steps, param fingerprints)
        self.warned = False
        self._params: tuple[Any, Any, frozenset[str]] | None = None  # (keys, state_ptrs, params) of the last save

    def count(self, *_: Any) -> None:
        """A watched optimizer's step post-hook (training thread)."""
        self.steps += 1

    def prepare(self, job: Any, state_ptrs: set[Hashable], identities: Callable[[], Sequence[Hashable]]) -> None:
        """Called in ``save()`` once the job exists: ask the workers to measure it, and mark which keys are
        parameters (every tensor but the watched optimizers' state, ``state_ptrs``; ``identities()``: each key's
        tensor's identity, asked for only here) and how many optimizer steps came before it."""
        if not self.measure:
            return
        job.health = {}
        if self.warn:
            last = self._params
            # a reused flattening (format/flatcache.py) hands every save the same keys list, with the same identities,
            # and the watched optimizers' unchanged state the same set: the parameter keys are those of the last save
            if last is not None and last[0] is job.keys and last[1] is state_ptrs:
                params = last[2]
            else:
                params = frozenset(k for k, i in zip(job.keys, identities()) if i not in state_ptrs)
                self._params = (job.keys, state_ptrs, params)
            job.stale_mark = StaleMark(self.steps, params)

    def committed(self, job: Any) -> None:
        """Called on the committer once ``job`` committed (saves commit in order)."""
        mark = job.stale_mark
        if mark is None or job.health_doc is None or not mark.params:
            return
        prints = fingerprints(job.health_doc, mark.params)
        if len(prints) != len(mark.params):
            return  # not every parameter measured: no verdict
        with self._lock:
            previous, self._previous = self._previous, (mark.steps, prints)
        if previous is None or self.warned or not job.health_doc["healthy"]:
            return  # a diverged run's parameters stay NaN, step after step: not a stale save
        steps = mark.steps - previous[0]
        if steps > 0 and previous[1] == prints:
            self.warned = True
            msg = (f"checkpoint {job.handle.name!r} (step {job.handle.step}) holds the same parameters, bit for bit, "
                   f"as the checkpoint before it, although the watched optimizer stepped {steps} time(s) in "
                   "between: the state passed to save() is not the one being trained (a copy made once, or a "
                   "reference the optimizer no longer updates). Pass the live model's state_dict() to every "
                   "save(). Said once per Checkpointer.")
            log.error("fastckpt: %s", msg)
            warnings.warn(msg, StaleCheckpointWarning, stacklevel=2)
