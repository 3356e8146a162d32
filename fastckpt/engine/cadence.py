"""`Cadence`: when to checkpoint, fixed (steps or seconds) or Young-Daly ``auto`` from measured costs."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..config import CadenceOptions
from ..errors import ConfigError

__all__ = ["Cadence", "CadenceStats", "young_daly", "expected_waste"]


def young_daly(cost_s: float, mtbf_s: float) -> float:
    """The interval (seconds) that minimises expected lost plus spent time: sqrt(2 * cost * MTBF) (Young 1974)."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * mtbf_s)


def expected_waste(interval_s: float, cost_s: float, mtbf_s: float) -> float:
    """The first-order fraction of time lost at ``interval_s``: the stall of each save (cost / interval) plus, per
    failure, half an interval of work redone (interval / 2 / MTBF). Young-Daly is its minimum."""
    if interval_s <= 0:
        return math.inf
    return cost_s / interval_s + interval_s / (2.0 * mtbf_s)


@dataclass(frozen=True, slots=True)
class CadenceStats:
    """What the cadence decided and why. Seconds throughout; NaN where nothing was measured yet.

    ``expected_loss_s``: the work a failure loses on average at the current cadence (half an interval);
    ``baseline_loss_s``: the same at ``cadence.baseline_interval`` (your fixed interval before ``auto``), or at
    ``interval`` itself when fixed; None without one. ``waste`` / ``baseline_waste``: the fraction of time lost
    to saves and redone work at each (``expected_waste``)."""

    mode: str  # "steps", "seconds" or "auto"
    interval_s: float
    interval_steps: int | None
    cost_s: float
    mtbf_s: float
    step_s: float
    saves_measured: int
    expected_loss_s: float
    baseline_loss_s: float | None
    waste: float
    baseline_waste: float | None

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}  # type: ignore[attr-defined]


class _Ema:
    """A running average; the first sample is taken as it is."""

    def __init__(self, weight: float) -> None:
        self.weight, self.value, self.count = weight, math.nan, 0

    def add(self, x: float) -> None:
        self.value = x if self.count == 0 else self.weight * x + (1 - self.weight) * self.value
        self.count += 1


class Cadence:
    """Answers ``should_save(step)`` once per training step, on the training thread (not thread-safe).

    ``interval`` N: steps that are multiples of N (as Lightning's ``every_n_train_steps``). ``every_s``: when that
    many seconds passed since the last save (or the first call). ``auto``: the Young-Daly interval in seconds,
    clamped to [min_interval_s, max_interval_s], turned into steps by the measured step time, and re-planned at
    each save from the smoothed costs ``observe`` was given. ``mtbf``: the current MTBF estimate (seconds), read at
    each re-plan when ``mtbf_s`` is not configured. ``agree``: with several processes, a collective that returns
    rank 0's value (every process calls it at the same step): a decision that depends on a clock is then rank 0's,
    so every process saves at the same step. ``clock``: seconds (tests pass their own)."""

    def __init__(self, options: CadenceOptions, *, mtbf: Callable[[], float] | None = None,
                 agree: Callable[[Any], Any] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if options.interval is None and options.every_s is None:
            raise ConfigError("no cadence configured: set cadence.interval (steps or auto) or cadence.every_s")
        self.options = options
        self.mode = "auto" if options.interval == "auto" else "steps" if options.interval is not None else "seconds"
        self._mtbf, self._agree, self._clock = mtbf, agree, clock
        self._cost = _Ema(options.smoothing)
        self._step_time = _Ema(options.smoothing)
        self._last: tuple[int, float] | None = None  # (step, time) of the previous call
        self._saved: tuple[int, float] | None = None  # (step, time) of the last save decided, or of the first call
        fixed = options.interval if isinstance(options.interval, int) else None
        self._interval_steps: int | None = fixed
        self._interval_s = options.every_s if self.mode == "seconds" else options.min_interval_s
        self._measuring = False  # auto: a save was decided before any cost was known, and none is known yet

    # ---- inputs -------------------------------------------------------------------------------------------

    def observe(self, cost_s: float) -> None:
        """One save's measured cost: the seconds it stalled training (``SaveStats.blocking_ms + waited_ms``)."""
        if not math.isfinite(cost_s) or cost_s < 0:
            raise ValueError(f"a checkpoint's cost must be finite seconds >= 0, got {cost_s!r}")
        self._cost.add(cost_s)

    def observe_stats(self, stats: Any) -> None:
        """``observe`` the stall of a finished save's ``SaveStats`` (a skipped save cost nothing worth learning)."""
        if not getattr(stats, "skipped", False):
            self.observe((stats.blocking_ms + stats.waited_ms) / 1e3)

    def restart(self, step: int, now: float | None = None) -> None:
        """The training state is that of ``step`` now (a ``load()``, a resume, a rollback): the next saves count
        from it, in steps and in seconds, as from a first call. Steps up to the last save are replayed, and would
        otherwise be refused as already saved. Costs and the step time learnt so far are kept."""
        now = self._clock() if now is None else now
        self._saved = (step, now)
        self._last = None  # the time across a load is not a step time

    # ---- the decision -------------------------------------------------------------------------------------

    def should_save(self, step: int, now: float | None = None) -> bool:
        """Whether to checkpoint at ``step`` (call once per step, after the step); a True is taken as a save.

        A step below the previous call's is a rollback that ``restart`` was not told of (a state loaded outside
        fastckpt): the cadence restarts from the step before it."""
        now = self._clock() if now is None else now
        if self._last is not None and step < self._last[0]:
            self.restart(step - 1, now)
        if self._last is not None and step > self._last[0]:
            self._step_time.add((now - self._last[1]) / (step - self._last[0]))
        self._last = (step, now)
        if self._saved is None:  # the first call starts the clock: nothing was at risk before it
            self._saved = (step, now)
            return self.mode == "steps" and step > 0 and step % self._interval_steps == 0  # type: ignore[operator]
        if step <= self._saved[0]:
            return False
        if self.mode == "auto" and self._measuring:
            # The first save's cost is not known yet (learnt once that save finished): another save now would only
            # queue behind it (with min_interval_s: 0 it saved every step until then, and persistence fell behind).
            # Rank 0 learns it (the saves' stats are its own), so it decides; max_interval_s bounds the wait, for a
            # loop that never calls observe().
            known = bool(self._cost.count) or now - self._saved[1] >= self.options.max_interval_s
            if self._agree is not None:
                known = bool(self._agree(known))
            if not known:
                return False
            self._plan()  # the interval from the first measured cost, agreed as at a save
        if self.mode == "steps":
            due = step % self._interval_steps == 0  # type: ignore[operator]
        elif self.mode == "auto" and self._interval_steps is not None:
            due = step - self._saved[0] >= self._interval_steps
        else:  # every_s, or auto before its first plan in steps: a clock decides, rank 0's where ranks must agree
            due = now - self._saved[1] >= self._interval_s
            if self._agree is not None:
                due = bool(self._agree(due))
        if due:
            self._saved = (step, now)
            if self.mode == "auto":
                self._plan()
        return due

    def _plan(self) -> None:
        """Re-choose the auto interval from the smoothed costs (at a save, where every process is at one step)."""
        self._interval_s = self._chosen_s()
        steps = None if not self._step_time.count else max(1, round(self._interval_s / max(self._step_time.value,
                                                                                           1e-9)))
        measuring = not self._cost.count  # no cost known: the next save waits until one is (should_save)
        if self._agree is not None:
            steps, measuring = self._agree((steps, measuring))  # rank 0's: only it may have learnt a cost
        self._interval_steps, self._measuring = steps, measuring

    def _chosen_s(self) -> float:
        o = self.options
        if not self._cost.count:  # no save measured yet: save soon, to measure one
            return o.min_interval_s
        return min(max(young_daly(self._cost.value, self.mtbf_s), o.min_interval_s), o.max_interval_s)

    # ---- reports ------------------------------------------------------------------------------------------

    @property
    def mtbf_s(self) -> float:
        """The configured MTBF, else the current estimate, else ``prior_mtbf_s``."""
        o = self.options
        if o.mtbf_s is not None:
            return float(o.mtbf_s)
        return float(self._mtbf()) if self._mtbf is not None else float(o.prior_mtbf_s)

    @property
    def interval_s(self) -> float:
        """The current interval in seconds (for ``steps``, the interval times the measured step time)."""
        if self.mode == "steps":
            steps = self._interval_steps or 0
            return steps * self._step_time.value if self._step_time.count else math.nan
        return self._interval_s

    @property
    def interval_steps(self) -> int | None:
        """The current interval in steps (None for ``every_s``, and for ``auto`` before its first plan)."""
        return self._interval_steps

    @property
    def stats(self) -> CadenceStats:
        o, mtbf, cost = self.options, self.mtbf_s, self._cost.value
        step_s = self._step_time.value
        interval = self.interval_s
        if o.baseline_interval is not None:
            base = o.baseline_interval * step_s if self._step_time.count else math.nan
        elif self.mode != "auto":
            base = interval
        else:
            base = None
        return CadenceStats(
            mode=self.mode, interval_s=interval, interval_steps=self._interval_steps, cost_s=cost, mtbf_s=mtbf,
            step_s=step_s, saves_measured=self._cost.count, expected_loss_s=interval / 2,
            baseline_loss_s=None if base is None else base / 2, waste=expected_waste(interval, cost, mtbf),
            baseline_waste=None if base is None else expected_waste(base, cost, mtbf))
