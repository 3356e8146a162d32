"""The plugin's ``root``: the default ``dirpath`` of the ``ModelCheckpoint``s that have none."""

from __future__ import annotations

import os
import warnings
from typing import Optional

import lightning.pytorch as pl

__all__ = ["adopt_root"]


def adopt_root(trainer: pl.Trainer, root: Optional[str], warned: bool) -> bool:
    """Give ``root`` to each ``ModelCheckpoint`` without a ``dirpath`` (before its setup resolves Lightning's default),
    and warn once (``warned``: already did; returned updated) when one has another ``dirpath``."""
    if root is None:
        return warned
    for callback in trainer.checkpoint_callbacks:
        dirpath = getattr(callback, "dirpath", None)
        if dirpath is None:  # before ModelCheckpoint.setup resolved its default: ours wins
            callback.dirpath = root
        elif os.fspath(dirpath).rstrip("/") != root.rstrip("/") and not warned:
            warned = True
            warnings.warn(
                f"FastCheckpointIO(root={root!r}) differs from ModelCheckpoint(dirpath={os.fspath(dirpath)!r});"
                " checkpoints go to the ModelCheckpoint's dirpath. Set one of them, or make them equal.",
                UserWarning,
                stacklevel=4,
            )
    return warned
