"""Load what a Lightning checkpoint path names: a pointer, a core checkpoint folder, or a plain torch file."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import fastckpt
from fastckpt import open_storage
from fastckpt.errors import CheckpointNotFoundError, StateMismatchError
from fastckpt.paths import confine
from lightning.fabric.utilities.cloud_io import _load as torch_load

from fastckpt_lightning.pointer import Pointer, join_path, read_pointer, split_path


def read_checkpoint(
    path: str,
    *,
    map_location: Any = None,
    storage_options: Optional[dict[str, Any]] = None,
    allowed_classes: Sequence[str] = (),
) -> dict[str, Any]:
    """The checkpoint dict stored at ``path``.

    ``path`` may be a pointer (what this plugin writes), a core checkpoint folder, or a torch ``.ckpt`` written by
    Lightning's default plugin, so a run can switch to fastckpt and still resume from its old checkpoints.
    """
    options = storage_options or {}
    pointer = read_pointer(path, options)
    if pointer is not None:
        return _read_parts(path, pointer, map_location, options, allowed_classes)
    if fastckpt.is_checkpoint(path, storage_options=options):
        return _load_part(path, map_location, options, allowed_classes)
    storage = open_storage(path, options)
    if storage.exists(storage.url):
        return torch_load(path, map_location=map_location, weights_only=True)  # never arbitrary pickles
    raise CheckpointNotFoundError(f"no checkpoint at {path!r}: not a fastckpt pointer, checkpoint folder or file")


def _read_parts(
    path: str, pointer: Pointer, map_location: Any, options: dict[str, Any], allowed: Sequence[str]
) -> dict[str, Any]:
    try:
        return _merge_parts(path, pointer, map_location, options, allowed)
    except CheckpointNotFoundError:
        # A trainer may have re-pointed `path` and deleted the old data while we read it: read the pointer again.
        fresh = read_pointer(path, options)
        if fresh is None or fresh == pointer:
            raise
        return _merge_parts(path, fresh, map_location, options, allowed)


def _merge_parts(
    path: str, pointer: Pointer, map_location: Any, options: dict[str, Any], allowed: Sequence[str]
) -> dict[str, Any]:
    folder, _ = split_path(path)
    merged: dict[str, Any] = {}
    for part in pointer.parts:
        # Parts are plain names (Pointer.from_bytes); a part that is a symlink leading out of dirpath is refused too.
        part_path = confine(folder, join_path(folder, part), f"{path}: data folder {part!r}")
        merged.update(_load_part(part_path, map_location, options, allowed))
    return merged


def _load_part(path: str, map_location: Any, options: dict[str, Any], allowed: Sequence[str]) -> dict[str, Any]:
    state = fastckpt.load_checkpoint(
        path, map_location=map_location, storage_options=options, allowed_classes=allowed
    )
    if not isinstance(state, dict):
        raise StateMismatchError(f"{path!r} holds a {type(state).__name__}, not a Lightning checkpoint dict")
    return state
