"""Split a Lightning checkpoint into weights and the rest, and recognise when weights can be shared.

Every Lightning checkpoint is saved as two core checkpoints. The *weights* part (``state_dict`` and
``optimizer_states``) has the same structure on every save, so the core reuses its plan and staging buffers. The
*state* part holds the small rest; its structure changes (``ModelCheckpoint`` keys ``best_k_models`` by file path),
which would otherwise force a new plan and new staging memory on every save.

``ModelCheckpoint(save_last=True)`` saves the top-k file and then ``last.ckpt`` at the same global step, from two
``dump_checkpoint`` calls. The weights are the same tensors with the same values (no optimizer step and no batch ran
in between), so the second save writes only its state part and its pointer names the first save's weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

# The top-level keys of a Lightning checkpoint that hold parameters, buffers and optimizer state.
SHARED_KEYS = ("state_dict", "optimizer_states")


@dataclass(frozen=True)
class SaveRecord:
    """What the previous full save wrote, to decide whether the next one can share it."""

    folder: str
    """Folder of the pointer (sharing never crosses folders, so garbage collection can stay per folder)."""
    path: str
    """The pointer path of that save."""
    step: int
    """Its global step."""
    batches_seen: int
    """The callback's batch counter at that save; any batch in between may have changed buffers."""
    fingerprint: tuple
    """Identity and layout of every tensor under :data:`SHARED_KEYS`, plus the plain values there."""
    part: str
    """The core checkpoint folder holding the weights."""
    handle: Any
    """Its ``SaveHandle``: a pointer that shares the data must also wait for (and fail with) that save."""


def fingerprint(checkpoint: Mapping[str, Any]) -> tuple:
    """A comparable summary of the shared keys: which tensors (by storage and layout) and which plain values."""
    return tuple((key, _fingerprint(checkpoint[key])) for key in SHARED_KEYS if key in checkpoint)


def shares_with(
    record: Optional[SaveRecord], folder: str, step: int, batches_seen: Optional[int], current: tuple
) -> bool:
    """Whether a save with these properties may reuse ``record``'s data for its shared keys."""
    return (
        record is not None
        and batches_seen is not None
        and record.folder == folder
        and record.step == step
        and record.batches_seen == batches_seen
        and record.fingerprint == current
    )


def split_checkpoint(checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(weights, state)``: the shared keys, and everything else. ``weights`` is empty for Fabric states."""
    weights = {key: checkpoint[key] for key in SHARED_KEYS if key in checkpoint}
    state = {key: value for key, value in checkpoint.items() if key not in SHARED_KEYS}
    return weights, state


def _fingerprint(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # Same storage, offset and layout means the same live tensor; values cannot have changed without a step.
        return (
            "tensor",
            value.untyped_storage().data_ptr(),
            value.storage_offset(),
            tuple(value.shape),
            tuple(value.stride()),
            str(value.dtype),
            str(value.device),
        )
    if isinstance(value, Mapping):
        return ("map", tuple((key, _fingerprint(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(_fingerprint(item) for item in value))
    return ("obj", repr(value))
