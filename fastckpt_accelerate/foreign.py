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
"""
from __future__ import annotations

import os
import pickle
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import accelerate.accelerator as accelerator_module
import torch

from fastckpt.errors import UnsafeCheckpointError

__all__ = ["OPT_IN", "load_accelerate_folder"]

OPT_IN = "fastckpt_accelerate.enable(accelerator, config, allow_unsafe_pickle=True)"
_PATCH_LOCK = threading.Lock()  # the patched name is module-global: one patched load at a time
# Files Accelerate loads with the caller's load_kwargs (checkpointing.load_accelerator_state).
_KWARGS_FILES = ("optimizer", "scheduler", "dl_state_dict")


def load_accelerate_folder(load_state: Callable[..., Any], path: str, load_kwargs: dict | None,
                           allow_unsafe_pickle: bool, **kwargs: Any) -> None:
    """Run Accelerate's ``load_state(path, load_kwargs, **kwargs)``; nothing unpickled unrestricted unless opted in."""
    if allow_unsafe_pickle:
        load_state(path, load_kwargs, **kwargs)
        return
    if (load_kwargs or {}).get("weights_only", True) is False:
        names = sorted(n for n in os.listdir(path) if n.startswith(_KWARGS_FILES)) or ["optimizer.bin"]
        raise UnsafeCheckpointError(
            f"{os.path.join(path, names[0])}: load_kwargs={{'weights_only': False}} would unpickle {', '.join(names)} "
            f"without restriction, which runs any code a crafted file holds; drop that load_kwarg, or opt in "
            f"with {OPT_IN} if you trust every file in {path}")
    with _safe_custom_state():
        load_state(path, load_kwargs, **kwargs)


@contextmanager
def _safe_custom_state() -> Iterator[None]:
    with _PATCH_LOCK:
        original = accelerator_module.load_custom_state
        accelerator_module.load_custom_state = _load_custom_state
        try:
            yield
        finally:
            accelerator_module.load_custom_state = original


def _load_custom_state(obj: Any, path: str, index: int = 0) -> None:
    """``accelerate.checkpointing.load_custom_state`` with ``weights_only=True``."""
    location = os.path.join(path, f"custom_checkpoint_{index}.pkl")
    try:
        state = torch.load(location, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{location}: holds objects torch's weights_only loader refuses (Accelerate would unpickle it with "
            f"weights_only=False, running any code in it); fastckpt refused. Opt in with {OPT_IN} only if you "
            f"trust this file ({str(e).splitlines()[0][:200]})") from e
    obj.load_state_dict(state)
