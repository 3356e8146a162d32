"""The ``Storage`` protocol every backend implements, and ``open_storage``, which picks the backend for a URL.

Only the ``storage`` folder touches fsspec (``fsspec.py``, with its deadlines in ``deadline.py``); local paths
take the fast path of ``local.py``.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from ..config import NetworkOptions
from .fsspec import FsspecStorage
from .local import LocalStorage

__all__ = ["Storage", "open_storage"]


@runtime_checkable
class Storage(Protocol):
    """What the pipeline needs from a place that holds checkpoints."""

    url: str

    def join(self, *parts: str) -> str:
        """Called by everyone to build child paths."""

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        """Called by an I/O worker: write ``parts`` back to back as one new, durable file."""

    def write_atomic(self, path: str, data: bytes) -> None:
        """Called by the committer: make ``path`` appear with ``data`` all at once (the commit)."""

    def write_file_atomic(self, path: str, parts: Sequence[memoryview]) -> None:
        """Called by the committer of a single-file checkpoint: ``write_file`` that appears only once complete."""

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Called by loaders: fill ``out`` from ``path`` starting at ``offset``."""

    def read_bytes(self, path: str) -> bytes:
        """Called by loaders for small files (manifest, metadata)."""

    def size(self, path: str) -> int:
        """File size in bytes; raises FileNotFoundError when absent."""

    def exists(self, path: str) -> bool:
        """Whether a file exists at ``path``."""

    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path`` (empty when it does not exist)."""

    def delete(self, path: str) -> None:
        """Remove one file; missing is fine."""

    def delete_tree(self, path: str) -> None:
        """Remove a directory and everything under it; missing is fine."""

    def check(self, what: str) -> None:
        """Called once when a Checkpointer is built: raise ``StorageError`` saying what to fix if
        checkpoints cannot be written under ``url`` (``what`` names the config field). Optional."""



def open_storage(root: str, storage_options: dict[str, Any] | None = None, *, direct_io: str = "auto",
                 fsync: bool = True, workers: int = 4, network: NetworkOptions | None = None) -> Storage:
    """Local paths and ``file://`` get ``LocalStorage``; every other URL goes through fsspec
    (its requests under ``network`` deadlines, the defaults when None)."""
    if "://" not in root or root.startswith("file://"):
        return LocalStorage(root, direct_io=direct_io, fsync=fsync)
    return FsspecStorage(root, storage_options or {}, workers=workers, network=network)
