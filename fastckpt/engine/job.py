"""A snapshot on its way to storage (``Job``): what save() made of the state, its staging slot, its copies' and
checks' progress and results, handed from save() to the copy thread, the I/O workers and the committer
(engine/pipeline.py) and read by the formats as their ``Snapshot`` (format/protocol.py)."""
from __future__ import annotations

import threading
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..format.openlayout import OPEN_LAYOUT

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..format.plan import Plan, Shard
    from ..format.protocol import FileFormat
    from .guard import VersionGuard
    from .handle import SaveHandle
    from .seal import Seal
    from .sharedfile import SharedFileWrite
    from .staging import Slot
    from .streams import CudaCopy

__all__ = ["Job"]


@dataclass(eq=False)
class Job:
    """One snapshot on its way to storage."""

    handle: SaveHandle
    plan: Plan
    slot: Slot
    tensors: list[torch.Tensor | None]  # a source is dropped once its copy is queued (GPU memory)
    keys: list[str]
    numpy: list[bool]
    tree: Any
    objects: bytes | None
    dirpath: str
    t0: float
    uid: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    writes: list[Future] = field(default_factory=list)
    cuda: CudaCopy | None = None  # per-device streams and ready events, when any tensor is on CUDA
    devices: list[str] = field(default_factory=list)  # each tensor's device (CUDA saves): map_location's key
    error: BaseException | None = None
    reported: bool = False  # the error was already raised from save() itself
    shard_events: dict[tuple[int, int], Any] = field(default_factory=dict)  # (shard, device) -> copied event
    copied_at: dict[int, float] = field(default_factory=dict)  # shard -> when its CUDA copies were seen done
    dtensors: list[dict[str, Any]] = field(default_factory=list)  # DTensorRecord.as_json() of each DTensor leaf
    guard: VersionGuard | None = None  # version counters of the lazy tensors, taken in save()
    staged_crcs: dict[int, list[int]] = field(default_factory=dict)  # shm: per shard, each tensor's CRC32C as staged
    file_format: FileFormat = OPEN_LAYOUT  # the open layout, or a framework's file(s)
    version_src: list[Any] | None = None  # what the mutation guard watches, per tensor (default: the tensors)
    shared: SharedFileWrite | None = None  # one file written by every rank: its commit protocol on this rank
    seal: Seal | None = None  # what the seal compares (lazy snapshots only)
    # staging.on_mutation "retake": called at the seal with the keys that moved (the refused snapshot is cleared)
    retake: Callable[[list[str]], None] | None = None
    retaken: bool = False  # refused and taken again under the same handle: fail quietly, leave the handle alone
    cleared: threading.Event = field(default_factory=threading.Event)  # set once the committer is done with it
    # shm: eager shards whose CUDA copies were still in flight when save() returned; the copy thread takes their
    # CRCs once the copies are done, and only then writes the record (which must claim only checked bytes)
    unchecked: list[Shard] = field(default_factory=list)
    to_record: list[Shard] = field(default_factory=list)  # lazy CUDA shards the seal samples once landed
    health: dict[str, Any] | None = None  # health.enabled: each staged tensor's statistics by key (I/O workers)
    staged_health: set[int] = field(default_factory=set)  # shards whose statistics the copy thread took (one pass)
    health_doc: dict[str, Any] | None = None  # their summary (format/health.py), set by the committer
    stale_mark: Any = None  # engine/stale.py: optimizer steps before this save, and its parameter keys
    dedup: Any = None  # engine/dedupwrite.py: a direct object-store root's copy source (single writer), or None
    records: bool = True  # shards list content records (format/contenthash.py): only for an upload with dedup, a copy
    # source, clones (what reads them); a pass over every byte otherwise spent for nothing
    cpu_section: Callable[[], Any] = nullcontext  # entered by a format around its CPU-bound work (engine/cpugate.py)
    token: Any = None  # format/flatcache.py's skeleton the state matched (what the seal derived from it is reused)
    fused: Any = None  # format/fused.py's compiled kernel, where ready when the job was submitted

    # what a FileFormat reads of a save (format/protocol.py's Snapshot)
    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def step(self) -> int:
        return self.handle.step
