"""The training step a checkpoint was taken at, read from the state Lightning or Fabric hands to the plugin."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

# Keys a Trainer (global_step) or a Fabric script (step, as in Fabric's docs) stores its step under.
STEP_KEYS = ("global_step", "step")


def step_of(checkpoint: Mapping[str, Any]) -> Optional[int]:
    """The step of ``checkpoint``: a top-level ``global_step`` or ``step``, else the optimizer steps taken
    (the ``step`` counter in an optimizer state, e.g. Adam's), else None."""
    for key in STEP_KEYS:
        value = _count(checkpoint.get(key))
        if value is not None:
            return value
    counts = [count for value in checkpoint.values() for count in _optimizer_steps(value)]
    return max(counts) if counts else None


def _count(value: Any) -> Optional[int]:
    """``value`` as a non-negative int (an int or a one-element tensor), else None."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _optimizer_steps(value: Any) -> list[int]:
    """The per-parameter ``step`` counters of an optimizer ``state_dict()`` (Fabric unwraps optimizers to them)."""
    if not (isinstance(value, Mapping) and isinstance(value.get("state"), Mapping) and "param_groups" in value):
        return []
    steps = (_count(s.get("step")) for s in value["state"].values() if isinstance(s, Mapping))
    return [s for s in steps if s is not None]
