"""Load what a Lightning checkpoint path names.

What this plugin writes is a genuine torch checkpoint file, loaded exactly as Lightning's own ``TorchCheckpointIO``
loads it (``torch.load`` with the caller's ``weights_only``, storages kept on the CPU unless ``map_location`` says
otherwise), after its CRC-32 fields are checked. Checkpoints of the plugin's earlier layout (a small JSON pointer
naming core checkpoint folders) and core checkpoint folders load too.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any, Optional

import fastckpt
from fastckpt import LocalStorage, open_storage
from fastckpt.errors import CheckpointNotFoundError, IntegrityError, StateMismatchError
from fastckpt.format.paths import confine
from fastckpt.format.torchfile import is_zip, verify_torch_bytes, verify_torch_file
from fastckpt.read.torchzip import load_torch_file
from lightning.fabric.utilities.cloud_io import _load as torch_load

from fastckpt_lightning import pending
from fastckpt_lightning.pointer import Pointer, join_path, read_pointer, split_path


def _keep_on_cpu(storage: Any, location: str) -> Any:
    return storage  # Lightning's TorchCheckpointIO default: storages stay where torch built them (the CPU)


def read_checkpoint(
    path: str,
    *,
    map_location: Any = None,
    weights_only: Optional[bool] = None,
    storage_options: Optional[dict[str, Any]] = None,
    allowed_classes: Sequence[str] = (),
    verify: bool = True,
) -> dict[str, Any]:
    """The checkpoint dict stored at ``path`` (waiting first for a save of ``path`` still in flight here)."""
    pending.wait_for(path)
    options = storage_options or {}
    pointer = read_pointer(path, options)
    if pointer is not None:
        return _read_parts(path, pointer, map_location, options, allowed_classes)
    if fastckpt.is_checkpoint(path, storage_options=options):
        return _load_part(path, map_location, options, allowed_classes)
    return _read_torch_file(path, map_location, weights_only, options, verify)


def _read_torch_file(
    path: str, map_location: Any, weights_only: Optional[bool], options: dict[str, Any], verify: bool
) -> dict[str, Any]:
    folder, name = split_path(path)
    storage = open_storage(folder, options)
    file = storage.join(storage.url, name)
    if not storage.exists(file):
        raise CheckpointNotFoundError(f"Checkpoint file not found: {path}")
    location = _keep_on_cpu if map_location is None else map_location
    if isinstance(storage, LocalStorage):
        with open(file, "rb") as f:
            head = f.read(4)
        if is_zip(head) and map_location is None and weights_only is not False:
            return _read_fast(file, weights_only, verify)
        if verify:
            _raise_problems(verify_torch_file(file) if is_zip(head) else [])
        return torch_load(file, map_location=location, weights_only=weights_only)
    data = storage.read_bytes(file)  # one read serves the check and the load
    if verify and is_zip(data[:4]):
        _raise_problems(verify_torch_bytes(data, path))
    return torch_load(io.BytesIO(data), map_location=location, weights_only=weights_only)


def _read_fast(file: str, weights_only: Optional[bool], verify: bool) -> dict[str, Any]:
    """Records read in parallel, each CRC-32 checked as it arrives, storages over the read buffer (one pass
    instead of a check pass and torch.load's pass). ``weights_only=None`` means torch's default: if the
    weights-only unpickler refuses the file, torch.load decides, as it would have."""
    try:
        # Storages tagged with a CUDA device stay on the CPU, as Lightning's own default: torch's default would put
        # them back on the saved device (raising on a CPU-only machine, and loading every DDP rank's copy onto cuda:0).
        return load_torch_file(file, map_location=_keep_on_cpu, verify=verify)
    except pickle.UnpicklingError:
        if weights_only:
            raise
        return torch_load(file, map_location=_keep_on_cpu, weights_only=None)


def _raise_problems(problems: list[str]) -> None:
    if problems:
        raise IntegrityError(
            "; ".join(problems) + ". The checkpoint is damaged: resume from an earlier one (`fastckpt verify` "
            "checks a file), or set persist.verify_on_load: false to load it anyway"
        )


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
