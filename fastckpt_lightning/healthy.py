"""Resuming from the newest healthy checkpoint: ``fit(ckpt_path="last-healthy")`` and ``find_healthy_checkpoint``.

Every ``.ckpt`` the plugin saves carries its health record (fastckpt/format/health.py: NaN/Inf totals, measured by
the background workers): in a local folder an extended attribute of the file itself (``user.fastckpt.health``, so the
folder lists exactly what stock Lightning writes), on an object store a hidden sidecar object beside it. A run that
diverged (a NaN at step N) resumes from the newest file whose tensors hold no NaN or Inf.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from lightning.pytorch.utilities import rank_zero_info

from fastckpt import open_storage
from fastckpt.errors import CheckpointNotFoundError, FastCkptError
from fastckpt.format.healthrecord import file_health, verdict

from fastckpt_lightning.discovery import find_calling_trainer
from fastckpt_lightning.pointer import join_path

log = logging.getLogger("fastckpt")

LAST_HEALTHY = "last-healthy"


def find_healthy_checkpoint(dirpath: str, storage_options: Optional[dict[str, Any]] = None) -> Optional[str]:
    """The newest ``.ckpt`` in ``dirpath`` (local or remote) whose health record shows no NaN or Inf, or None: pass
    it as ``fit(ckpt_path=...)``. Files are ranked by the step their record holds; a file without one (saved by
    stock Lightning, with ``health.enabled: false``, or on a file system without user attributes) is never chosen."""
    found = _newest_healthy(dirpath, storage_options)
    return None if found is None else found[1]


def _newest_healthy(dirpath: str, storage_options: Optional[dict[str, Any]]) -> Optional[tuple[int, str]]:
    """(step, path) of ``find_healthy_checkpoint``'s file, or None."""
    storage = open_storage(dirpath, storage_options)
    ranked = []
    for name in storage.listdir(storage.url):
        if not name.endswith(".ckpt") or name.startswith("."):
            continue
        path = storage.join(storage.url, name)
        try:
            health = file_health(storage, path)
        except (FastCkptError, OSError) as e:  # one crafted or unreadable record must not stop the resume
            log.warning("fastckpt: ignoring the health record of %s: %s", name, e)
            continue
        if verdict(health) is True:  # complete, and agreeing with itself (format/health.py)
            ranked.append((health.get("step", -1), name))
    if not ranked:
        return None
    step, name = max(ranked)
    return step, join_path(dirpath.rstrip("/"), name)


def last_healthy_or(path: Any, plugin: Any) -> Any:
    """``path``, or for ``ckpt_path="last-healthy"`` the newest healthy file of the calling trainer's
    ``ModelCheckpoint`` folder (else the plugin's ``root``). Raises ``CheckpointNotFoundError`` when there is none."""
    if os.fspath(path) != LAST_HEALTHY:
        return path
    trainer = find_calling_trainer(plugin)
    callback = trainer.checkpoint_callback if trainer is not None else None
    dirpath = getattr(callback, "dirpath", None) or plugin.root
    storage_options = plugin.config.storage_options
    if dirpath is None:
        raise CheckpointNotFoundError(f'ckpt_path="{LAST_HEALTHY}" needs a folder: give ModelCheckpoint a dirpath '
                                      "or FastCheckpointIO a root")
    found = _newest_healthy(str(dirpath), storage_options)
    if found is None:
        raise CheckpointNotFoundError(
            f'ckpt_path="{LAST_HEALTHY}": no checkpoint in {dirpath} has a health record without NaN or Inf; pass '
            "ckpt_path=find_healthy_checkpoint(dirpath) (None on a first run) to start from scratch instead")
    step, chosen = found
    # Lightning has just said "Restoring states from the checkpoint path at last-healthy": name the file, through
    # Lightning's own logger (shown where its messages are), once.
    rank_zero_info(f'fastckpt: ckpt_path="{LAST_HEALTHY}" is {chosen} (step {step}), the newest checkpoint in '
                   f"{dirpath} whose health record holds no NaN or Inf")
    return chosen
