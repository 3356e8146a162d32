"""Per-checkpoint statistics, and their logging through ``LightningModule.log`` when asked for."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Optional

from fastckpt import SaveStats
from lightning.pytorch import LightningModule

PREFIX = "fastckpt/"


@dataclass(frozen=True)
class CheckpointStats:
    """What one ``save_checkpoint`` call cost. Built once its file is durable."""

    path: str
    """The path Lightning asked for."""
    step: int
    """Global step of the checkpoint."""
    blocking_ms: float
    """Time the training thread spent inside ``save_checkpoint``."""
    waited_ms: float
    """Time the training thread waited for the lazy copy before the next optimizer step (the rest of the stall)."""
    staging_ms: float
    """Time until the host copy was complete (lazy copies overlap with training)."""
    persist_s: float
    """Time until the file was durable under its name."""
    nbytes: int
    """Size of the file."""
    throughput_mb_s: float
    """``nbytes`` over ``persist_s``, in MB/s."""
    written_bytes: int = 0
    """What this process wrote of the file: all of it, unless the DDP ranks share its writes (``FastDDPStrategy``)."""

    @property
    def stall_ms(self) -> float:
        """What this checkpoint cost the training thread: ``blocking_ms + waited_ms``."""
        return self.blocking_ms + self.waited_ms

    @classmethod
    def of(cls, path: str, stats: SaveStats) -> CheckpointStats:
        """The record of one file, from the core's figures of its save."""
        return cls(
            path=path,
            step=stats.step,
            blocking_ms=stats.blocking_ms,
            waited_ms=stats.waited_ms,
            staging_ms=stats.staging_ms,
            persist_s=stats.persist_s,
            nbytes=stats.nbytes,
            throughput_mb_s=stats.throughput_mb_s,
            written_bytes=stats.written_bytes,
        )

    def metrics(self) -> dict[str, float]:
        """The numbers as ``fastckpt/<field>`` metrics for ``Logger.log_metrics``."""
        values = asdict(self)
        del values["path"], values["step"]
        values["stall_ms"] = self.stall_ms
        return {f"{PREFIX}{key}": float(value) for key, value in values.items()}


class StatsBook:
    """Thread-safe record of finished checkpoints; remembers which ones were already logged.

    It keeps the core's live ``SaveStats`` and builds the records when read (on the training thread): a wait
    for the lazy copy books its ``waited_ms`` after the copy ends, which may be after the commit.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: list[tuple[str, SaveStats]] = []
        self._logged = 0

    def __getstate__(self) -> dict[str, Any]:  # the plugin is pickled with the trainer (ddp_spawn): records only
        with self._lock:
            return {"_all": list(self._all), "_logged": self._logged}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def add(self, path: str, stats: SaveStats) -> None:
        """Record one finished checkpoint. Called on the core's committer thread."""
        with self._lock:
            self._all.append((path, stats))

    def all(self) -> list[CheckpointStats]:
        """A record of every checkpoint, oldest first."""
        with self._lock:
            return [CheckpointStats.of(path, stats) for path, stats in self._all]

    def take_unlogged(self) -> list[CheckpointStats]:
        """Records not yet handed to a logger; each is returned once."""
        with self._lock:
            fresh, self._logged = self._all[self._logged :], len(self._all)
        return [CheckpointStats.of(path, stats) for path, stats in fresh]


def log_newest(pl_module: LightningModule, records: list[CheckpointStats]) -> None:
    """Log the newest of ``records`` through ``pl_module.log`` (in a training batch hook, on the training thread).

    Lightning keeps a step value until it is logged again, and writes it only in the rows of the user's
    ``log_every_n_steps``: each such row then carries the figures of the newest checkpoint committed so far (a
    gauge), and no row or step is added. Rank 0's figures, as Lightning's loggers write only there."""
    for key, value in records[-1].metrics().items():
        pl_module.log(key, value, on_step=True, on_epoch=False, prog_bar=False, logger=True, rank_zero_only=True)


def summary(records: Iterable[CheckpointStats]) -> Optional[dict[str, Any]]:
    """Totals and means over ``records`` (None when empty), for printing at the end of a run."""
    records = list(records)
    if not records:
        return None
    count = len(records)
    return {
        "checkpoints": count,
        "bytes": sum(r.nbytes for r in records),
        "mean_blocking_ms": sum(r.blocking_ms for r in records) / count,
        "mean_stall_ms": sum(r.stall_ms for r in records) / count,
        "mean_staging_ms": sum(r.staging_ms for r in records) / count,
        "mean_persist_s": sum(r.persist_s for r in records) / count,
        "max_blocking_ms": max(r.blocking_ms for r in records),
    }
