"""``FileFormat``: the one protocol every on-disk format implements, so the engine never asks which one it holds.

A format decides headers and byte offsets and what "committed" means; the engine (engine/pipeline.py) stages
tensors into host buffers and calls the format's hooks in this order, for every save:

1. ``write_shard`` on an I/O worker, for each shard this process staged, as soon as its copy is done;
2. ``commit`` on the committer, once every shard is written (on the committing rank only, when ranks share one
   checkpoint): it writes what depends on all shards (metadata, a zip directory, a manifest) and publishes the
   checkpoint atomically (a rename or a manifest written last);
3. or ``discard`` on the committer, instead of ``commit``, once the save failed.

Three formats implement it: the open layout (``layout.OpenLayout``: safetensors shards, meta, manifest), a torch
file (``torchfile.TorchFileFormat``) and a framework's folder of files (``bundle.FileBundle``).
"""
from __future__ import annotations

from concurrent.futures import Executor
from typing import Any, Callable, Protocol

from ..storage.protocol import Storage
from .layout import CheckpointInfo, FileRecord
from .plan import Plan, Shard

__all__ = ["FileFormat", "Snapshot", "ShardResult", "StagedBytes"]

# What ``write_shard`` returns, per shard: (shard index, the file it wrote (size 0 when it wrote none), the CRC
# of each of its tensors). A plain tuple: ranks sharing a checkpoint gather them with pickle.
ShardResult = tuple[int, FileRecord, list[int]]
# Each staged tensor's bytes and checksum by table index, read from the slot that still holds them.
StagedBytes = Callable[[], tuple[dict[int, memoryview], dict[int, int]]]


class Snapshot(Protocol):
    """What a format reads of one save (engine/pipeline.py's ``Job`` is one)."""

    name: str
    step: int
    dirpath: str  # where the checkpoint goes: its folder, or the folder holding its file
    uid: str  # unique per save: file names carry it, so a re-save never overwrites bytes still referenced
    plan: Plan
    keys: list[str]
    numpy: list[bool]
    devices: list[str]
    tree: Any
    objects: bytes | None
    dtensors: list[dict[str, Any]]
    staged_crcs: dict[int, list[int]]  # per shard, each tensor's CRC32C once taken (shm, copy or health pass)
    health_doc: dict[str, Any] | None  # the health record to commit (format/health.py); None: not measured
    dedup: Any  # objectdedup.DedupSource of a direct object-store root (its shards' copy source), or None
    records: bool  # list each shard's content records (format/contenthash.py): an upload, a copy or a clone reads them


class FileFormat(Protocol):
    """How one save's staged shards become files; see the module docstring for the call order."""

    catalogued: bool
    """A commit is a checkpoint of the root: listed, retained, uploaded, and loadable from shared memory."""

    keeps_shards: bool
    """``commit`` reads the staged bytes again, so the staging slot holds every shard until then."""

    def write_shard(self, storage: Storage, snap: Snapshot, shard: Shard, data: memoryview) -> ShardResult:
        """Called by an I/O worker once ``shard`` is staged in ``data``: write or checksum it."""

    def commit(self, storage: Storage, snap: Snapshot, results: list[ShardResult], staged: StagedBytes,
               pool: Executor) -> tuple[CheckpointInfo, int]:
        """Called by the committer once every shard is written: publish the checkpoint (the commit point) and
        return it with the bytes this call wrote (``pool``: the idle I/O workers, for parallel writes)."""

    def discard(self, storage: Storage, snap: Snapshot) -> None:
        """Called by the committer after a failure: remove what this save may have written (never another's)."""
