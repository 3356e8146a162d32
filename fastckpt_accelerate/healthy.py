"""The newest checkpoint to load, or the newest healthy one: ``load_state(healthy=True)`` and ``latest(healthy=True)``.

Each folder fastckpt saves for Accelerate carries the health of its tensors in its ``manifest.json`` (NaN/Inf
counts, norms and fingerprints, measured by the background workers; fastckpt/format/health.py), a file stock
``load_state`` never reads. ``healthy=True`` skips the folders of a run that diverged.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from fastckpt.errors import CheckpointNotFoundError


def newest(infos: Sequence[Any], root: str, healthy: bool = False) -> Any:
    """The newest of ``infos`` (``CheckpointInfo``; with ``healthy``, the newest whose tensors hold no NaN or Inf).
    Raises ``CheckpointNotFoundError`` naming ``root`` when there is none."""
    found = newest_or_none(infos, healthy)
    if found is not None:
        return found
    if not infos:
        raise CheckpointNotFoundError(
            f"no committed fastckpt checkpoint under {root}; pass load_state(path) to load another one")
    sick = sum(1 for i in infos if i.healthy is False)
    raise CheckpointNotFoundError(
        f"no healthy checkpoint under {root}: {len(infos)} committed, {sick} with NaN/Inf values, the others not "
        "measured (saved with health.enabled: false or by an older fastckpt) or with a record that contradicts "
        "itself; pass load_state(path) to load one")


def newest_or_none(infos: Sequence[Any], healthy: bool = False) -> Optional[Any]:
    """The newest of ``infos`` (the newest healthy one with ``healthy``), or None."""
    good = [i for i in infos if i.healthy or not healthy]
    return max(good, key=lambda i: i.step) if good else None
