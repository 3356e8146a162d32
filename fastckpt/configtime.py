"""The config sections about time: flushing on preemption and the cadence of checkpoints.

Split from ``config.py`` (which re-exports both and holds them in ``CheckpointConfig``) to keep each module small.
"""
from __future__ import annotations

import math
import signal
from dataclasses import dataclass, field

from .configbase import Freezable, check_int, check_seconds
from .errors import ConfigError

__all__ = ["CadenceOptions", "PreemptionOptions"]


# Signals a preemption handler may not take: SIGKILL and SIGSTOP cannot be caught, the others are faults or
# job control, whose default action must stay.
_UNCATCHABLE = ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGCHLD", "SIGTSTP")


@dataclass(kw_only=True, slots=True)
class PreemptionOptions(Freezable):
    """Flush on preemption (fastckpt/engine/preempt.py): on a signal or notice, a final checkpoint at the next safe
    point (a watched optimizer's step, or ``point()`` between steps), flushed with everything pending within
    ``grace_s``; then the signal goes on to the handler installed before (or its default action).

    Off by default: it replaces process-wide signal handlers (only possible on the main thread) and delays the
    signal's effect by up to ``grace_s``, a change of behaviour a library must not make unasked."""

    _prefix = "preemption."
    enabled: bool = False
    """Install the handlers when a Checkpointer (or an integration's) is built."""
    signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signal names that mean preemption (``SIGTERM``; SLURM: add ``SIGUSR1``, or its ``--signal``)."""
    grace_s: float = 30.0
    """Seconds from the signal within which the final checkpoint and every pending save should be committed;
    after it the signal goes on regardless (set it below the SIGKILL delay of your scheduler)."""
    notice_file: str | None = None
    """A path whose appearance means preemption (a spot or maintenance notice an agent writes); checked twice a
    second by a background thread. Null: none."""

    def validate(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ConfigError(f"preemption.enabled must be true or false, got {self.enabled!r}")
        if isinstance(self.signals, str) or not isinstance(self.signals, (list, tuple)):
            raise ConfigError(f"preemption.signals must be a list of signal names such as [SIGTERM], got {self.signals!r}")
        names = []
        for s in self.signals:
            name = s.upper() if isinstance(s, str) else s
            name = name if not isinstance(name, str) or name.startswith("SIG") else "SIG" + name
            if not isinstance(name, str) or not isinstance(getattr(signal, name, None), signal.Signals) \
                    or name in _UNCATCHABLE:
                raise ConfigError(f"preemption.signals: {s!r} is not a signal that can mean preemption; use names "
                                  "such as SIGTERM, SIGUSR1, SIGUSR2, SIGINT")
            names.append(name)
        self.signals = list(dict.fromkeys(names))
        check_seconds("preemption.", "grace_s", self.grace_s, 0.0)
        if self.notice_file is not None and (not isinstance(self.notice_file, str) or not self.notice_file):
            raise ConfigError(f"preemption.notice_file must be a path or null, got {self.notice_file!r}")
@dataclass(kw_only=True, slots=True)
class CadenceOptions(Freezable):
    """When to checkpoint: what ``Checkpointer.should_save(step)`` (and the integrations' triggers) answer.

    ``interval: auto`` picks the Young-Daly interval sqrt(2 * cost * MTBF), which minimises the time a failure
    loses plus the time checkpoints stall training (docs/CADENCE.md); ``cost`` is measured from each save's stall
    (``SaveStats.blocking_ms + waited_ms``), the MTBF configured or estimated from this root's record of runs.
    """

    _prefix = "cadence."
    interval: int | str | None = None
    """Save every N steps (an integer), ``auto`` (Young-Daly, re-estimated as costs change), or null (no
    cadence: ``should_save`` raises unless ``every_s`` is set)."""
    every_s: float | None = None
    """Save when this many seconds passed since the last save (a time-based cadence); excludes ``interval``."""
    mtbf_s: float | None = None
    """Mean time between failures, in seconds; null estimates it from the root's record of runs
    (``.fastckpt-runs.json``: runs that ended without ``close()`` count as failures), starting from
    ``prior_mtbf_s``."""
    prior_mtbf_s: float = 86400.0
    """The MTBF assumed before any failure was seen (worth one failure in the estimate)."""
    min_interval_s: float = 10.0
    """``auto`` never saves more often than this (also the interval until a save's cost was measured)."""
    max_interval_s: float = 3600.0
    """``auto`` never waits longer than this between saves."""
    baseline_interval: int | None = None
    """Your fixed interval (steps) before ``auto``: the cadence stats report what a failure would lose at it."""
    smoothing: float = 0.3
    """Weight of the newest measurement in the running averages of cost and step time (0 < x <= 1)."""

    def validate(self) -> None:
        iv, every = self.interval, self.every_s
        if iv is not None and iv != "auto" and (isinstance(iv, bool) or not isinstance(iv, int) or iv < 1):
            raise ConfigError(f"cadence.interval must be an integer >= 1, `auto` or null, got {iv!r}")
        if every is not None:
            if isinstance(every, bool) or not isinstance(every, (int, float)) or not 0 < every < math.inf:
                raise ConfigError(f"cadence.every_s must be a finite number of seconds > 0, or null, got {every!r}")
            if iv is not None:
                raise ConfigError(f"cadence.interval ({iv!r}) and cadence.every_s ({self.every_s!r}) exclude each "
                                  "other: set one of them to null")
        if self.mtbf_s is not None:
            check_seconds("cadence.", "mtbf_s", self.mtbf_s, 0.001)
        check_seconds("cadence.", "prior_mtbf_s", self.prior_mtbf_s, 0.001)
        check_seconds("cadence.", "min_interval_s", self.min_interval_s, 0.0)
        check_seconds("cadence.", "max_interval_s", self.max_interval_s, 0.0)
        if self.max_interval_s < self.min_interval_s:
            raise ConfigError(f"cadence.max_interval_s ({self.max_interval_s}) must be >= cadence.min_interval_s "
                              f"({self.min_interval_s})")
        check_int("cadence.", "baseline_interval", self.baseline_interval, 1, allow_none=True)
        sm = self.smoothing
        if isinstance(sm, bool) or not isinstance(sm, (int, float)) or not 0 < sm <= 1:
            raise ConfigError(f"cadence.smoothing must be a number in (0, 1], got {sm!r}")
