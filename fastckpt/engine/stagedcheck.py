"""The CRC32C of what a shared-memory snapshot staged, taken before its record is written (``staging.shm``).

A slot's crash record may claim only bytes whose checksums were taken after they landed, and ``wait_staged()``
returns only once the record is in place (fastckpt/tiers/shm.py): so these checksums stand between the copies and
the training thread's next optimizer step. Taken one shard after another on the copy thread, each after that shard's
copies landed, they kept the copy engine waiting too (the next shard was queued only after the previous one's CRC),
and 1.96 GB cost the training thread 1.1 s a checkpoint on an H200 host (gpu_bench, persister variant, 2026-11-26).
So every copy is queued first, then the shards are checksummed in parallel as they land, on threads of their own
(the CRC32C releases the GIL), as many as half the CPUs, at most ``MAX_THREADS``; on a host of few CPUs, one.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from ..format.healthpass import usable_cpus
from .staging import staged_crcs
from .cudastage import landed

__all__ = ["StagedChecker", "MAX_THREADS"]

MAX_THREADS = 8


def _threads() -> int:
    return max(1, min(MAX_THREADS, usable_cpus() // 2))


def check_staged(job: Any, shard: Any) -> None:
    """The CRC of each of ``shard``'s tensors as staged (the record carries them), once its copies landed."""
    landed(job, shard)  # a CRC of bytes the DMA is still writing is a lie
    job.staged_crcs[shard.index] = staged_crcs(job.slot.held(shard), shard)


class StagedChecker:
    """Owned by the pipeline; called by its copy thread only. Its threads start at the first shared-memory
    snapshot of more than one shard, and stop at ``close()``."""

    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._name = name
        self._initializer = initializer  # run by each of its threads as it starts (engine/affinity.py)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def check(self, job: Any, shards: Sequence[Any]) -> None:
        """Checksum ``shards`` of ``job`` (every copy already queued); raise the first failure."""
        if len(shards) <= 1 or _threads() == 1:
            for shard in shards:
                check_staged(job, shard)
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_threads(), thread_name_prefix=self._name,
                                                initializer=self._initializer)
            pool = self._pool
        futures = [pool.submit(check_staged, job, shard) for shard in shards]
        errors = [f.exception() for f in futures]  # all of them done: none still reads the slot afterwards
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
