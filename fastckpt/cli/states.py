"""Loading any supported checkpoint as one nested state, and walking state trees.

``export`` and ``import`` convert through this: whatever the layout (see ``layout.py``), the
result is the dict ``torch.load`` / ``Checkpointer.load`` would return. Every torch file is read
with ``weights_only=True``: the command line never unpickles arbitrary objects.
"""
from __future__ import annotations

import io
import sys
from typing import Any, Callable, Iterator

from ..errors import CheckpointNotFoundError, ConfigError, UnsafeCheckpointError
from .. import LocalStorage
from .layout import accelerate_files, kind_of, locate, Located, pointer_parts
from .progress import CountingStorage, counting_file
from .text import clean

__all__ = ["load_state", "torch_load", "leaves", "subtree", "DEFAULT_KEY"]

# The subtree ``export --to safetensors`` takes when ``--key`` is not given, per kind.
DEFAULT_KEY = {"torch": "state_dict", "pointer": "state_dict", "accelerate": "model", "core": "model",
               "dcp": "model"}


Count = Callable[[int], None]


def load_state(path: str, options: dict[str, Any], count: Count | None = None) -> tuple[str, Any]:
    """(kind, state) of the checkpoint at ``path``: tensors on the CPU, bytes verified where checksummed.
    ``count(n)`` is told of the bytes read as they are (``fastckpt.cli.progress``; DCP folders are not counted)."""
    loc = locate(path, options)
    kind = kind_of(loc)
    if kind == "core":
        return kind, _core_state(loc.path, options, count)
    if kind == "pointer":  # fastckpt 0.1's Lightning layout: later parts override top-level keys
        merged: dict[str, Any] = {}
        for part in pointer_parts(loc) or []:
            merged.update(_core_state(part, options, count))
        return kind, merged
    if kind == "torch":
        return kind, torch_load(loc, count)
    if kind == "accelerate":
        return kind, _accelerate_state(loc, count)
    return kind, _dcp_state(loc)


def _core_state(path: str, options: dict[str, Any], count: Count | None) -> Any:
    """``load_checkpoint(path)``; counted through a ``CountingStorage`` only while someone watches (the wrapper
    hides ``LocalStorage``'s mapped reads from the reader)."""
    from .. import CheckpointReader, load_checkpoint, open_storage
    from ..format.manifest import checkpoint_dir

    if count is None:
        return load_checkpoint(path, storage_options=options)
    storage = open_storage(checkpoint_dir(path), options)
    return CheckpointReader(CountingStorage(storage, count), storage.url, verify=True).load(None)


def torch_load(loc: Located, count: Count | None = None) -> Any:
    """``torch.load(weights_only=True)`` of one file; a refusal names the file and what to do."""
    import pickle

    import torch

    source: Any = loc.path
    if not isinstance(loc.storage, LocalStorage):
        storage = loc.storage if count is None else CountingStorage(loc.storage, count)
        source = io.BytesIO(storage.read_bytes(loc.path))  # one read: torch seeks all over the file
    elif count is not None:
        source = counting_file(loc.path, count)
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as e:
        raise UnsafeCheckpointError(
            f"{loc.path}: torch.load(weights_only=True) refused it: {str(e).splitlines()[0]}. fastckpt's command "
            "line never unpickles arbitrary objects; load it in your own code if you trust it") from e
    finally:
        if not isinstance(source, str):
            source.close()


def _accelerate_state(loc: Located, count: Count | None = None) -> dict[str, Any]:
    """The stock Accelerate files as one dict keyed by file stem (``model``, ``optimizer``, ``scheduler``...)."""
    from safetensors.torch import load as load_safetensors

    state: dict[str, Any] = {}
    storage = loc.storage if count is None else CountingStorage(loc.storage, count)
    for name, file, stem in accelerate_files(loc):
        if name.endswith(".safetensors"):
            state[stem] = load_safetensors(storage.read_bytes(file.path))
            continue
        try:
            state[stem] = torch_load(file, count)
        except UnsafeCheckpointError as e:  # random_states_N.pkl holds numpy RNG state: not weights_only
            print(f"fastckpt: warning: skipped {clean(' '.join(str(e).split()))}", file=sys.stderr)
    return state


def _dcp_state(loc: Located) -> dict[str, Any]:
    """A ``torch.distributed.checkpoint`` folder, read in this one process (what ``dcp_to_torch_save`` does)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    if not isinstance(loc.storage, LocalStorage):
        raise ConfigError(f"{loc.path}: DCP checkpoints are read from local folders only; copy it here first")
    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(loc.path), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return state


def leaves(obj: Any, prefix: str = "", sep: str = ".") -> Iterator[tuple[str, Any]]:
    """(key path joined by ``sep``, leaf) of a nested dict/list/tuple, in order."""
    if isinstance(obj, dict):
        items: Any = ((str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(obj))
    else:
        yield prefix, obj
        return
    empty = True
    for k, v in items:
        empty = False
        yield from leaves(v, f"{prefix}{sep}{k}" if prefix else k, sep)
    if empty and prefix:
        yield prefix, obj


def subtree(state: Any, key: str, source: str) -> Any:
    """``state[a][b]`` for ``key="a.b"``; a missing key lists the keys there, so the user can pick."""
    node = state
    for part in key.split(".") if key else []:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            keys = sorted(map(str, node)) if isinstance(node, dict) else []
            raise CheckpointNotFoundError(f"{source}: no key {key!r} (at {part!r}); keys there: {keys[:50]}. "
                                          "Pick one with --key")
    return node
