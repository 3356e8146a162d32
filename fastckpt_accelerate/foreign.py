"""Load a folder written by Accelerate's own ``save_state`` without running code pickled in it.

Accelerate 1.15 reads most files with ``torch.load(weights_only=True)``, but two paths unpickle
without restriction (``accelerate/checkpointing.py``):

- ``load_custom_state`` always passes ``weights_only=False`` for ``custom_checkpoint_{i}.pkl`` (the
  objects given to ``register_for_checkpointing``): a planted file runs its payload on load;
- ``load_kwargs={"weights_only": False}`` reaches the optimizer, scheduler and dataloader files.

Unless the user opts in (``enable(..., allow_unsafe_pickle=True)``), the first is replaced for the
duration of the call by a ``weights_only=True`` load (plain state dicts still load, code is refused
with ``UnsafeCheckpointError`` naming the file), and the second is refused before anything is read.
Replacing the function, not checking the files first, leaves no window to swap a file in between.

Given a ``fastload.FolderReader``, the same call also routes the reads of ``load_state`` through it: Accelerate's
``load`` (torch files) and ``load_model`` (safetensors weights) are replaced for the call, so stock code decides
what is restored and fastckpt how the bytes are read and checked.
"""
from __future__ import annotations

import functools
import os
import pickle
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import accelerate.accelerator as accelerator_module
import accelerate.checkpointing as checkpointing_module
import torch
from accelerate.utils.other import TORCH_SAFE_GLOBALS

from fastckpt.errors import UnsafeCheckpointError

from .fastload import FolderReader

__all__ = ["OPT_IN", "load_accelerate_folder"]

OPT_IN = "fastckpt_accelerate.enable(accelerator, config, allow_unsafe_pickle=True)"
_PATCH_LOCK = threading.Lock()  # the patched names are module-global: one patched load at a time
# Files Accelerate loads with the caller's load_kwargs (checkpointing.load_accelerator_state).
_KWARGS_FILES = ("optimizer", "scheduler", "dl_state_dict")
_ACCELERATE_GLOBALS = tuple(TORCH_SAFE_GLOBALS)  # what Accelerate's ``load`` allows in weights-only unpickling


def load_accelerate_folder(load_state: Callable[..., Any], path: str, load_kwargs: dict | None,
                           allow_unsafe_pickle: bool, reader: FolderReader | None = None, **kwargs: Any) -> None:
    """Run Accelerate's ``load_state(path, load_kwargs, **kwargs)``; nothing unpickled unrestricted unless opted in;
    with ``reader``, its files are read (and checked) by it."""
    if not allow_unsafe_pickle and (load_kwargs or {}).get("weights_only", True) is False:
        names = sorted(n for n in os.listdir(path) if n.startswith(_KWARGS_FILES)) or ["optimizer.bin"]
        raise UnsafeCheckpointError(
            f"{os.path.join(path, names[0])}: load_kwargs={{'weights_only': False}} would unpickle {', '.join(names)} "
            f"without restriction, which runs any code a crafted file holds; drop that load_kwarg, or opt in "
            f"with {OPT_IN} if you trust every file in {path}")
    with _patched(reader, safe_custom_state=not allow_unsafe_pickle):
        load_state(path, load_kwargs, **kwargs)


@contextmanager
def _patched(reader: FolderReader | None, safe_custom_state: bool) -> Iterator[None]:
    """Replace, for one ``load_state``, the module-global names it reads files with."""
    with _PATCH_LOCK:
        originals = (accelerator_module.load_custom_state, checkpointing_module.load, checkpointing_module.load_model)
        if safe_custom_state:
            accelerator_module.load_custom_state = functools.partial(_load_custom_state, reader)
        if reader is not None:
            load, load_model = originals[1], originals[2]
            checkpointing_module.load = functools.partial(reader.load_with, load, extra_globals=_ACCELERATE_GLOBALS)
            checkpointing_module.load_model = functools.partial(reader.load_model, load_model)
        try:
            yield
        finally:
            (accelerator_module.load_custom_state, checkpointing_module.load,
             checkpointing_module.load_model) = originals


def _load_custom_state(reader: FolderReader | None, obj: Any, path: str, index: int = 0) -> None:
    """``accelerate.checkpointing.load_custom_state`` with ``weights_only=True`` (through ``reader`` if given)."""
    location = os.path.join(path, f"custom_checkpoint_{index}.pkl")
    try:
        if reader is None:
            state = torch.load(location, map_location="cpu", weights_only=True)
        else:
            state = reader.load_with(torch.load, location, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{location}: holds objects torch's weights_only loader refuses (Accelerate would unpickle it with "
            f"weights_only=False, running any code in it); fastckpt refused. Opt in with {OPT_IN} only if you "
            f"trust this file ({str(e).splitlines()[0][:200]})") from e
    obj.load_state_dict(state)
