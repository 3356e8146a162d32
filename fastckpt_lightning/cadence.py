"""`FastModelCheckpoint(every="auto")`: when to save, decided by the core's cadence (Young-Daly or ``every_s``).

Every rank asks at the same batch end; a decision that depends on a clock, and each new interval in steps, are
rank 0's (``trainer.strategy.broadcast``), so the ranks always save together, as Lightning's own
``train_time_interval`` does.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Optional

import lightning.pytorch as pl
from fastckpt import Cadence, CadenceOptions, CadenceStats, ConfigError, open_cadence, open_storage

__all__ = ["CadenceTrigger"]


class CadenceTrigger:
    """The cadence of one ``FastModelCheckpoint``: built at the first batch end, fed each checkpoint's stall."""

    def __init__(self, every: int | str | None, every_s: float | None, baseline: int | None,
                 cadence: CadenceOptions | Mapping[str, Any] | None) -> None:
        fields = dict(cadence.__getstate__() if isinstance(cadence, CadenceOptions) else (cadence or {}))
        if every is not None:
            fields["interval"] = every
        if every_s is not None:
            fields["every_s"] = every_s
        if baseline and fields.get("baseline_interval") is None:
            fields["baseline_interval"] = baseline  # the user's every_n_train_steps: what auto is compared with
        try:
            self.options = CadenceOptions(**fields)
        except TypeError as e:
            raise ConfigError(f"FastModelCheckpoint(cadence=...): {e}; the fields are those of CadenceOptions "
                              "(docs/CONFIG.md, section cadence)") from e
        self.cadence: Cadence | None = None
        self._runs: Any = None
        self._seen = 0  # the plugin's stats already learnt from
        self._timed: Optional[float] = None  # the stall measured here, without a fastckpt plugin

    def due(self, trainer: pl.Trainer, root: Optional[str]) -> bool:
        """Whether to save at this batch end (every rank calls it; they all get rank 0's answer)."""
        if self.cadence is None:
            storage = open_storage(root) if root and trainer.is_global_zero and self.options.mtbf_s is None else None
            agree = trainer.strategy.broadcast if trainer.world_size > 1 else None
            self.cadence, self._runs = open_cadence(self.options, storage, agree=agree,
                                                    record=trainer.is_global_zero)
        self._learn(trainer)
        return self.cadence.should_save(trainer.global_step)

    def _learn(self, trainer: pl.Trainer) -> None:
        stats = getattr(trainer.strategy.checkpoint_io, "stats", None)  # FastCheckpointIO's committed saves
        if isinstance(stats, list):
            for st in stats[self._seen:]:
                self.cadence.observe(st.stall_ms / 1e3)  # type: ignore[union-attr]
            self._seen = len(stats)
        elif self._timed is not None:  # another CheckpointIO: the time the save blocked is all we know
            self.cadence.observe(self._timed)  # type: ignore[union-attr]
        self._timed = None

    def timing(self) -> "_Timer":
        """Measure a save's blocking time (used only without a fastckpt plugin)."""
        return _Timer(self)

    def seen(self) -> None:
        """A save was made: this run was alive now (rank 0's record of runs)."""
        if self._runs is not None:
            self._runs.seen()

    def end(self) -> None:
        """Training finished cleanly: no failure in the record of runs."""
        if self._runs is not None:
            self._runs.end()

    @property
    def stats(self) -> Optional[CadenceStats]:
        return None if self.cadence is None else self.cadence.stats


class _Timer:
    def __init__(self, trigger: CadenceTrigger) -> None:
        self.trigger = trigger

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.trigger._timed = time.perf_counter() - self.t0  # noqa: SLF001 - the same module
