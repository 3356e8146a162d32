"""fastckpt: nearly free checkpointing for PyTorch training.

The public names are imported on first use (PEP 562): ``import fastckpt`` stays cheap, so the
``fastckpt`` command answers ``--help`` without importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Checkpointer": ".checkpointer",
    "WatchHandle": ".checkpointer",
    "CheckpointConfig": ".config",
    "StagingOptions": ".config",
    "PersistOptions": ".config",
    "RetentionOptions": ".config",
    "RemoteOptions": ".config",
    "NetworkOptions": ".config",
    "SaveHandle": ".handle",
    "SaveStats": ".handle",
    "CheckpointInfo": ".handle",
    "CheckpointReader": ".loader",
    "LoadStats": ".loadstats",
    "load_checkpoint": ".loader",
    "is_checkpoint": ".loader",
    "consolidate": ".consolidate",
    "Storage": ".storage",
    "LocalStorage": ".storage",
    "FsspecStorage": ".storage",
    "open_storage": ".storage",
    "FastCkptError": ".errors",
    "ConfigError": ".errors",
    "StorageError": ".errors",
    "CheckpointTimeoutError": ".errors",
    "IntegrityError": ".errors",
    "CheckpointNotFoundError": ".errors",
    "StateMismatchError": ".errors",
    "UnsafeCheckpointError": ".errors",
    "SnapshotMutatedError": ".errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    try:  # ``fastckpt.checksum.crc32c`` after a bare ``import fastckpt``, as with eager imports
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # type checkers and IDEs see the eager imports
    from .checkpointer import Checkpointer, WatchHandle
    from .config import (CheckpointConfig, NetworkOptions, PersistOptions, RemoteOptions, RetentionOptions,
                         StagingOptions)
    from .errors import (CheckpointNotFoundError, CheckpointTimeoutError, ConfigError, FastCkptError,
                         IntegrityError, SnapshotMutatedError, StateMismatchError, StorageError,
                         UnsafeCheckpointError)
    from .handle import CheckpointInfo, SaveHandle, SaveStats
    from .consolidate import consolidate
    from .loader import CheckpointReader, is_checkpoint, load_checkpoint
    from .loadstats import LoadStats
    from .storage import FsspecStorage, LocalStorage, Storage, open_storage
