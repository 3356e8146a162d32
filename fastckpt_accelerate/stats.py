"""Report each finished save through ``accelerator.log`` (TensorBoard, W&B, ... trackers)."""

from __future__ import annotations

from typing import Any, Iterable

from accelerate import Accelerator

PREFIX = "fastckpt/"


def stats_to_values(stats: Any) -> dict[str, float]:
    """The numbers of one core ``SaveStats``, as tracker scalars."""
    return {
        f"{PREFIX}blocking_ms": float(stats.blocking_ms),
        f"{PREFIX}staging_ms": float(stats.staging_ms),
        f"{PREFIX}waited_ms": float(stats.waited_ms),
        f"{PREFIX}stall_ms": float(stats.blocking_ms + stats.waited_ms),  # what the save cost the training loop
        f"{PREFIX}persist_s": float(stats.persist_s),
        f"{PREFIX}nbytes": float(stats.nbytes),
        f"{PREFIX}written_bytes": float(stats.written_bytes),
        f"{PREFIX}throughput_mb_s": float(stats.throughput_mb_s),
    }


class StatsLogger:
    """Logs each save's stats once; called on the training thread, because trackers are not thread-safe."""

    def __init__(self, accelerator: Accelerator) -> None:
        self._accelerator = accelerator
        self._logged: set[tuple[str, int]] = set()

    def log_new(self, stats: Iterable[Any]) -> int:
        """Log the stats not logged yet; returns how many were logged."""
        count = 0
        for item in stats:
            key = (item.name, item.step)
            if key in self._logged:
                continue
            self._logged.add(key)
            self._accelerator.log(stats_to_values(item), step=item.step)
            count += 1
        return count
