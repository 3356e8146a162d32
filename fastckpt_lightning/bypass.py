"""Strategies whose checkpoints never reach the plugin: said once, by name, instead of silently not used.

Stock ``ModelParallelStrategy`` (when it saves a distributed checkpoint, its default) and ``FSDPStrategy`` with
``state_dict_type="sharded"`` call torch.distributed.checkpoint directly on every rank, and ``DeepSpeedStrategy``
calls DeepSpeed's own ``save_checkpoint``: ``Trainer(plugins=[FastCheckpointIO()])`` with one of them writes
checkpoints without fastckpt (no overlap, no manifest, no checksums). fastckpt's own strategies with the same
arguments (``FastModelParallelStrategy``, ``FastFSDPStrategy``) save that sharded state through the plugin.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

__all__ = ["bypass_reason", "warn_if_bypassed"]


def bypass_reason(strategy: Any) -> Optional[str]:
    """Why ``strategy`` saves without the plugin, and what to use instead; None when its saves go through it.

    Judged by the ``save_checkpoint`` it runs: stock's own (a subclass that overrides it, fastckpt's strategies
    included, decides for itself), and by the settings that send stock's to DCP. Those settings are Lightning's
    own attributes (2.6 has no public accessor), read by name with a default, so another version only loses the
    warning."""
    name = type(strategy).__name__
    save = type(strategy).save_checkpoint
    if isinstance(strategy, ModelParallelStrategy) and save is ModelParallelStrategy.save_checkpoint:
        if getattr(strategy, "_save_distributed_checkpoint", True):
            return (f"{name} saves its sharded checkpoints with torch.distributed.checkpoint directly, never through "
                    "FastCheckpointIO: fastckpt is not used for them. Use "
                    "fastckpt_lightning.FastModelParallelStrategy (same arguments) to save them through the plugin.")
    if isinstance(strategy, FSDPStrategy) and save is FSDPStrategy.save_checkpoint:
        if getattr(strategy, "_state_dict_type", None) == "sharded":
            return (f"{name}(state_dict_type='sharded') saves its checkpoints with torch.distributed.checkpoint "
                    "directly, never through FastCheckpointIO: fastckpt is not used for them. Use "
                    "fastckpt_lightning.FastFSDPStrategy (same arguments) to save them through the plugin.")
    if isinstance(strategy, DeepSpeedStrategy) and save is DeepSpeedStrategy.save_checkpoint:
        return (f"{name} saves its checkpoints with DeepSpeed's own save_checkpoint, never through "
                "FastCheckpointIO: fastckpt is not used for them (fastckpt has no DeepSpeed strategy).")
    return None


def warn_if_bypassed(strategy: Any, warned: bool) -> bool:
    """Warn once (``warned``: already did; returned updated) when ``strategy``'s checkpoints bypass the plugin; on
    global rank 0 only, as Lightning's own warnings."""
    if warned:
        return True
    reason = bypass_reason(strategy)
    if reason is None:
        return False
    if getattr(strategy, "global_rank", 0) == 0:
        warnings.warn(reason, UserWarning, stacklevel=4)
    return True
