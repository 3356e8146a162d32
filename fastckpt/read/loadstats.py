"""What one load did: which tier served it, how many bytes, how long, whether they were verified."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoadStats", "TIERS"]

TIERS = ("shm", "local", "remote")  # nearest first: the order in which a load looks for a committed step


@dataclass(slots=True)
class LoadStats:
    """Filled by ``CheckpointReader.load``/``load_into``; ``Checkpointer.last_load_stats`` keeps the last one."""

    name: str
    step: int
    tier: str  # one of TIERS
    method: str  # "map" (local files mapped), "read" (parallel ranged reads), "into" (into the target), "shm"
    nbytes: int = 0  # tensor bytes read (or mapped) and, with ``verified``, checksummed
    seconds: float = 0.0
    verified: bool = True  # CRC32C checked against the manifest / the shared-memory record

    @property
    def gbps(self) -> float:
        """Read bandwidth in GB/s (0 for an empty or instantaneous load)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
