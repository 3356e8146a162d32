"""Load a folder written by Accelerate's own ``save_state`` without running code pickled in it.

Accelerate 1.15 reads most files with ``torch.load(weights_only=True)``, but two paths unpickle
without restriction (``accelerate/checkpointing.py``):

- ``load_custom_state`` always passes ``weights_only=False`` for ``custom_checkpoint_{i}.pkl`` (the
  objects given to ``register_for_checkpointing``): a planted file runs its payload on load;
- ``load_kwargs={"weights_only": False}`` reaches the optimizer, scheduler and dataloader files.

Unless the user opts in (``enable(..., allow_unsafe_pickle=True)``), the first is replaced for the
duration of the call by a ``weights_only=True`` load allowing what torch's weights-only loader allows, plus
Accelerate's safe globals, numpy's arrays and scalars (``fastckpt.format.picklecheck.numpy_safe_globals``) and the
config's ``allowed_classes`` (plain state dicts, tensors and numpy arrays load as with stock; code is refused with
``UnsafeCheckpointError`` naming the file), and the second is refused before anything is read. ``save_loaders``
tells the save which loader reads each file, so that a state that would be refused fails the save instead.
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
from typing import Any, Callable, Iterator, Sequence

import accelerate.accelerator as accelerator_module
import accelerate.checkpointing as checkpointing_module
import torch
from accelerate.utils.other import TORCH_SAFE_GLOBALS

from fastckpt.errors import UnsafeCheckpointError
from fastckpt.format.picklecheck import PickleLoader, allowing, numpy_safe_globals, resolve_globals

from .fastload import FolderReader

__all__ = ["OPT_IN", "custom_state_globals", "load_accelerate_folder", "save_loaders"]

OPT_IN = "fastckpt_accelerate.enable(accelerator, config, allow_unsafe_pickle=True)"
_PATCH_LOCK = threading.Lock()  # the patched names are module-global: one patched load at a time
# Files Accelerate loads with the caller's load_kwargs (checkpointing.load_accelerator_state).
_KWARGS_FILES = ("optimizer", "scheduler", "dl_state_dict")
_ACCELERATE_GLOBALS = tuple(TORCH_SAFE_GLOBALS)  # what Accelerate's ``load`` allows in weights-only unpickling
_STOCK_READER = "Accelerate's load_state (torch.load(weights_only=True) with Accelerate's safe globals, with or " \
                "without fastckpt)"
_CUSTOM_READER = "fastckpt's load_state (torch's weights_only loader with numpy's and Accelerate's safe globals " \
                 "and config allowed_classes)"


def custom_state_globals(allowed_classes: Sequence[str] = ()) -> tuple[Any, ...]:
    """What a registered object's ``custom_checkpoint_N.pkl`` may hold beyond torch's own allowlist: Accelerate's
    safe globals, numpy arrays and scalars, and the config's ``allowed_classes`` (``module.QualName``)."""
    return (*_ACCELERATE_GLOBALS, *numpy_safe_globals(), *resolve_globals(allowed_classes))


def save_loaders(names: Sequence[str], allowed_classes: Sequence[str],
                 allow_unsafe_pickle: bool) -> dict[str, PickleLoader]:
    """The loader ``load_state`` will read each torch file of ``names`` with, for the check before a save commits.
    Registered objects' files: fastckpt's (unrestricted, as stock, once opted in); the files ``load_kwargs`` reach:
    Accelerate's weights-only ``load`` unless opted in (then ``load_kwargs={'weights_only': False}`` may read them);
    every other torch file: Accelerate's weights-only ``load``, with or without fastckpt."""
    custom = PickleLoader(custom_state_globals(allowed_classes), _CUSTOM_READER,
                          "store plain values in the object's state_dict() (numbers, strings, lists, dicts, tensors, "
                          "numpy arrays), list the classes in config allowed_classes, or opt in with "
                          f"{OPT_IN} if you trust every checkpoint you will load")
    stock = PickleLoader(_ACCELERATE_GLOBALS, _STOCK_READER,
                         "store plain values in that state_dict() (numbers, strings, lists, dicts, tensors); stock "
                         "Accelerate could not load this file either")
    out: dict[str, PickleLoader] = {}
    for name in names:
        if name.startswith("custom_checkpoint_"):
            if not allow_unsafe_pickle:
                out[name] = custom
        elif not (allow_unsafe_pickle and name.startswith(_KWARGS_FILES)):
            out[name] = stock
    return out


def load_accelerate_folder(load_state: Callable[..., Any], path: str, load_kwargs: dict | None,
                           allow_unsafe_pickle: bool, reader: FolderReader | None = None,
                           allowed_classes: Sequence[str] = (), **kwargs: Any) -> None:
    """Run Accelerate's ``load_state(path, load_kwargs, **kwargs)``; nothing unpickled unrestricted unless opted in;
    with ``reader``, its files are read (and checked) by it; ``allowed_classes``: the config's, allowed in the
    registered objects' files."""
    if not allow_unsafe_pickle and (load_kwargs or {}).get("weights_only", True) is False:
        names = sorted(n for n in os.listdir(path) if n.startswith(_KWARGS_FILES)) or ["optimizer.bin"]
        raise UnsafeCheckpointError(
            f"{os.path.join(path, names[0])}: load_kwargs={{'weights_only': False}} would unpickle {', '.join(names)} "
            f"without restriction, which runs any code a crafted file holds; drop that load_kwarg, or opt in "
            f"with {OPT_IN} if you trust every file in {path}")
    custom = None if allow_unsafe_pickle else custom_state_globals(allowed_classes)
    with _patched(reader, custom):
        load_state(path, load_kwargs, **kwargs)


@contextmanager
def _patched(reader: FolderReader | None, custom: tuple[Any, ...] | None) -> Iterator[None]:
    """Replace, for one ``load_state``, the module-global names it reads files with."""
    with _PATCH_LOCK:
        originals = (accelerator_module.load_custom_state, checkpointing_module.load, checkpointing_module.load_model)
        if custom is not None:
            accelerator_module.load_custom_state = functools.partial(_load_custom_state, reader, custom)
        if reader is not None:
            load, load_model = originals[1], originals[2]
            checkpointing_module.load = functools.partial(reader.load_with, load, extra_globals=_ACCELERATE_GLOBALS)
            checkpointing_module.load_model = functools.partial(reader.load_model, load_model)
        try:
            yield
        finally:
            (accelerator_module.load_custom_state, checkpointing_module.load,
             checkpointing_module.load_model) = originals


def _load_custom_state(reader: FolderReader | None, allowed: tuple[Any, ...], obj: Any, path: str,
                       index: int = 0) -> None:
    """``accelerate.checkpointing.load_custom_state`` with ``weights_only=True`` and ``allowed``
    (``custom_state_globals``) beyond torch's allowlist (through ``reader`` if given)."""
    location = os.path.join(path, f"custom_checkpoint_{index}.pkl")
    try:
        if reader is None:
            with allowing(allowed):
                state = torch.load(location, map_location="cpu", weights_only=True)
        else:
            state = reader.load_with(torch.load, location, map_location="cpu", weights_only=True,
                                     extra_globals=allowed)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(
            f"{location}: holds objects torch's weights_only loader refuses, even with numpy's and Accelerate's "
            f"safe globals and config allowed_classes (Accelerate would unpickle it with weights_only=False, running "
            f"any code in it); fastckpt refused. List the classes in config allowed_classes if you trust them, or "
            f"opt in with {OPT_IN} only if you trust this file ({str(e).splitlines()[0][:200]})") from e
    obj.load_state_dict(state)
