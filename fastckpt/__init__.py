"""fastckpt: nearly free checkpointing for PyTorch training."""
from .checkpointer import Checkpointer, WatchHandle
from .config import (CheckpointConfig, NetworkOptions, PersistOptions, RemoteOptions, RetentionOptions,
                     StagingOptions)
from .errors import (
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    ConfigError,
    FastCkptError,
    IntegrityError,
    SnapshotMutatedError,
    StateMismatchError,
    StorageError,
    UnsafeCheckpointError,
)
from .handle import CheckpointInfo, SaveHandle, SaveStats
from .loader import CheckpointReader, is_checkpoint, load_checkpoint
from .loadstats import LoadStats
from .storage import FsspecStorage, LocalStorage, Storage, open_storage

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "WatchHandle",
    "CheckpointConfig",
    "StagingOptions",
    "PersistOptions",
    "RetentionOptions",
    "RemoteOptions",
    "NetworkOptions",
    "SaveHandle",
    "SaveStats",
    "CheckpointInfo",
    "CheckpointReader",
    "LoadStats",
    "load_checkpoint",
    "is_checkpoint",
    "Storage",
    "LocalStorage",
    "FsspecStorage",
    "open_storage",
    "FastCkptError",
    "ConfigError",
    "StorageError",
    "CheckpointTimeoutError",
    "IntegrityError",
    "CheckpointNotFoundError",
    "StateMismatchError",
    "UnsafeCheckpointError",
    "SnapshotMutatedError",
]
