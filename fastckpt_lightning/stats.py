"""Per-checkpoint statistics and their logging to Lightning loggers."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Optional

from fastckpt import SaveStats
from lightning.pytorch.loggers import Logger

PREFIX = "fastckpt/"


@dataclass(frozen=True)
class CheckpointStats:
    """What one ``save_checkpoint`` call cost. Built once its data is committed."""

    path: str
    """The path Lightning asked for (the pointer)."""
    step: int
    """Global step of the checkpoint."""
    blocking_ms: float
    """Time the training thread spent inside ``save_checkpoint``."""
    staging_ms: float
    """Time until the host copy was complete (lazy copies overlap with training)."""
    persist_s: float
    """Time to write and commit the data."""
    nbytes: int
    """Bytes written for this call (only the small state part when the weights were shared)."""
    throughput_mb_s: float
    """``nbytes`` over ``persist_s``, in MB/s."""
    deduplicated: bool
    """True when the weights were shared with the checkpoint saved just before at the same step."""

    @classmethod
    def combine(
        cls, path: str, step: int, blocking_ms: float, parts: Sequence[SaveStats], deduplicated: bool
    ) -> CheckpointStats:
        """One record from the core stats of the parts this call wrote (they ran concurrently)."""
        nbytes = sum(part.nbytes for part in parts)
        persist_s = max(part.persist_s for part in parts)
        return cls(
            path=path,
            step=step,
            blocking_ms=blocking_ms,
            staging_ms=max(part.staging_ms for part in parts),
            persist_s=persist_s,
            nbytes=nbytes,
            throughput_mb_s=nbytes / 1e6 / persist_s if persist_s > 0 else 0.0,
            deduplicated=deduplicated,
        )

    def metrics(self) -> dict[str, float]:
        """The numbers as ``fastckpt/<field>`` metrics for ``Logger.log_metrics``."""
        values = asdict(self)
        del values["path"], values["step"]
        return {f"{PREFIX}{key}": float(value) for key, value in values.items()}


class StatsBook:
    """Thread-safe record of finished checkpoints; remembers which ones were already logged."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: list[CheckpointStats] = []
        self._logged = 0

    def add(self, stats: CheckpointStats) -> None:
        """Record one finished checkpoint. Called by the publisher thread."""
        with self._lock:
            self._all.append(stats)

    def all(self) -> list[CheckpointStats]:
        """A copy of every record, oldest first."""
        with self._lock:
            return list(self._all)

    def take_unlogged(self) -> list[CheckpointStats]:
        """Records not yet handed to a logger; each is returned once."""
        with self._lock:
            fresh, self._logged = self._all[self._logged :], len(self._all)
            return fresh


def log_to(loggers: Iterable[Logger], records: Iterable[CheckpointStats]) -> None:
    """Send each record to every logger at the record's step. Must run on the training thread (loggers are not
    thread-safe)."""
    loggers = list(loggers)
    for record in records:
        for logger in loggers:
            logger.log_metrics(record.metrics(), step=record.step)


def summary(records: Iterable[CheckpointStats]) -> Optional[dict[str, Any]]:
    """Totals and means over ``records`` (None when empty), for printing at the end of a run."""
    records = list(records)
    if not records:
        return None
    count = len(records)
    return {
        "checkpoints": count,
        "deduplicated": sum(r.deduplicated for r in records),
        "bytes": sum(r.nbytes for r in records),
        "mean_blocking_ms": sum(r.blocking_ms for r in records) / count,
        "mean_staging_ms": sum(r.staging_ms for r in records) / count,
        "mean_persist_s": sum(r.persist_s for r in records) / count,
        "max_blocking_ms": max(r.blocking_ms for r in records),
    }
