"""fastckpt: nearly free checkpointing for PyTorch training. This module is the public API (``__all__``).

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
    "WatchHandle": ".engine.watch",
    "CheckpointConfig": ".config",
    "StagingOptions": ".config",
    "PersistOptions": ".config",
    "RetentionOptions": ".config",
    "RemoteOptions": ".config",
    "NetworkOptions": ".config",
    "PreemptionOptions": ".config",
    "Preemption": ".engine.preempt",
    "CadenceOptions": ".config",
    "Cadence": ".engine.cadence",
    "CadenceStats": ".engine.cadence",
    "young_daly": ".engine.cadence",
    "open_cadence": ".tiers.runs",
    "HealthOptions": ".config",
    "SaveHandle": ".engine.handle",
    "SaveStats": ".engine.handle",
    "CheckpointInfo": ".format.layout",
    "CheckpointReader": ".read.loader",
    "LoadStats": ".read.loadstats",
    "load_checkpoint": ".read.loader",
    "is_checkpoint": ".read.loader",
    "consolidate": ".read.consolidate",
    "Storage": ".storage.protocol",
    "LocalStorage": ".storage.local",
    "FsspecStorage": ".storage.fsspec",
    "open_storage": ".storage.protocol",
    "FastCkptError": ".errors",
    "ConfigError": ".errors",
    "StorageError": ".errors",
    "FolderRemovedError": ".errors",
    "CheckpointTimeoutError": ".errors",
    "MissingCredentialsError": ".errors",
    "IntegrityError": ".errors",
    "CheckpointNotFoundError": ".errors",
    "StateMismatchError": ".errors",
    "UnsafeCheckpointError": ".errors",
    "SnapshotMutatedError": ".errors",
    "StaleCheckpointWarning": ".errors",
    "RetakenSnapshotWarning": ".errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    try:  # ``fastckpt.config`` after a bare ``import fastckpt``, as with eager imports
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # type checkers and IDEs see the eager imports
    from .checkpointer import Checkpointer
    from .engine.watch import WatchHandle
    from .config import (CadenceOptions, CheckpointConfig, HealthOptions, NetworkOptions, PersistOptions,
                         PreemptionOptions, RemoteOptions, RetentionOptions, StagingOptions)
    from .engine.cadence import Cadence, CadenceStats, young_daly
    from .engine.preempt import Preemption
    from .tiers.runs import open_cadence
    from .errors import (CheckpointNotFoundError, CheckpointTimeoutError, ConfigError, FastCkptError,
                         IntegrityError, MissingCredentialsError, RetakenSnapshotWarning, SnapshotMutatedError,
                         StateMismatchError, StorageError, StaleCheckpointWarning, UnsafeCheckpointError)
    from .format.layout import CheckpointInfo
    from .engine.handle import SaveHandle, SaveStats
    from .read.consolidate import consolidate
    from .read.loader import CheckpointReader, is_checkpoint, load_checkpoint
    from .read.loadstats import LoadStats
    from .storage.fsspec import FsspecStorage
    from .storage.local import LocalStorage
    from .storage.protocol import Storage, open_storage
