"""``complete_folders``: a new local checkpoint folder appears under its name only once its save committed.

By default a folder exists from the moment ``save_state()`` returns, as with stock Accelerate (its own tests check
``os.path.exists`` right after the call), and holds only ``.fastckpt-pending`` until the files are written: a copy
taken too early copies the marker, without an error. With ``enable(..., complete_folders=True)`` the main process
creates a hidden sibling instead (``fastckpt.format.bundle.staging_path``: ``.fastckpt-staging-0.checkpoint_12``),
the save is written and committed there (pre-hooks' files included), and the committer renames it to its name: a
reader sees the complete folder or no folder ("No such file or directory"), never a partial one.

A folder that exists already (an ``output_dir`` saved again, a folder the user made) is written in place, as without
the option: renaming over it would drop the user's own files in it, and its removal by the user (a
``TemporaryDirectory`` cleanup) could not be told from a folder that never existed.
"""
from __future__ import annotations

import logging
import os
import shutil

from fastckpt.errors import ConfigError
from fastckpt.format.bundle import staging_path

from .naming import is_url

__all__ = ["check_complete_folders", "stage"]

logger = logging.getLogger(__name__)


def check_complete_folders(root: str, shared_writes: bool | None) -> None:
    """``complete_folders=True`` needs a local root, and the main process writing every file."""
    if is_url(root):
        raise ConfigError(
            f"complete_folders=True needs a local root, not {root}: on an object store a folder is a prefix with no "
            "rename; there manifest.json is the commit (copy a folder only once it lists manifest.json)")
    if shared_writes:
        raise ConfigError("complete_folders=True with shared_writes=True: the processes' shared writes go straight "
                          "into the folder; pass shared_writes=None (the main process then writes every file and "
                          "renames the folder into place at its commit)")


def stage(folder: str) -> str | None:
    """Main process, once no save of ``folder`` by this process is pending: create its staging folder (and the
    parents, as Accelerate creates them) and return its path; None where ``folder`` exists (written in place). A
    staging folder already there is a killed save's leftover: never listed, counted or loaded, and removed here, by
    the next save of that name (a resumed run's first save takes the name its killed save had)."""
    if os.path.lexists(folder):
        return None
    staging = staging_path(folder)
    if os.path.lexists(staging):
        logger.warning("fastckpt: removing %s, the unfinished staging folder of an earlier save of %s", staging, folder)
        shutil.rmtree(staging)
    os.makedirs(os.path.dirname(staging), exist_ok=True)
    os.mkdir(staging)
    return staging
