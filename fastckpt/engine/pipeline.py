"""The background pipeline: copy thread -> I/O workers -> committer.

Each staged shard is handed to an I/O worker as soon as its copy finishes, so the
device-to-host copy of shard *i+1* overlaps the write of shard *i*. The committer
handles jobs strictly in save order: it waits for a job's files, writes the
metadata, then the manifest (the commit), then garbage. Deletions travel through
the same queue, so they always run behind the saves submitted before them.

Threads: ``fastckpt-copy`` and ``fastckpt-commit`` are owned by ``Pipeline`` and
stop on a ``None`` sentinel; ``fastckpt-io-*`` (at ``persist.priority``, fastckpt/engine/priority.py) and ``fastckpt-boost-*``
(never lowered, used only while the kernel refuses to raise the first) are executors shut down by ``close``.
"""
from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from ..config import StagingOptions
from ..errors import FastCkptError, StorageError
from ..format import fused
from ..format.health import HealthPart, attr_bytes, measured, summarize
from ..format.layout import CheckpointInfo
from ..format.openlayout import OPEN_LAYOUT
from ..format.plan import Shard
from ..format.protocol import ShardResult
from ..storage.protocol import Storage
from .distributed import Coordinator
from .guard import LazyOrder, VersionGuard
from .seal import Seal
from .stagedcheck import StagedChecker, check_staged
from .sealing import await_seal, record_staged, seal_job
from .priority import ThreadPriorities
from .affinity import ThreadPlacement
from .job import Job
from .cpugate import CpuGate, auto_limit
from .onepass import stage_batched
from .serialops import serial_here
from .threadsignals import quiet
from .cudastage import all_landed, landed, queue_shard, shard_stats, submitted
from .staging import HostArena, copy_entries
from .streams import host_wait, shard_events, snapshotted
from .writepace import WritePacer

__all__ = ["Job", "Pipeline"]

log = logging.getLogger("fastckpt")
_ids = itertools.count(1)


class Pipeline:
    """Owns the background threads of one ``Checkpointer``."""

    def __init__(self, storage: Storage, arena: HostArena, workers: int,
                 on_commit: Callable[[Job, CheckpointInfo], None],
                 on_failure: Callable[[Job, FastCkptError], None], coord: Coordinator | None = None,
                 priorities: ThreadPriorities | None = None) -> None:
        self.storage = storage
        self._priorities = priorities or ThreadPriorities("idle")
        self._coord = coord
        self._arena = arena
        self._on_commit = on_commit
        self._on_failure = on_failure
        n = next(_ids)  # several Checkpointers may live in one process
        self.placement = ThreadPlacement()  # persist.background_cpus: which CPUs these threads run on (affinity.py)
        self._io = ThreadPoolExecutor(workers, thread_name_prefix=f"fastckpt-io-{n}",  # serial: engine/serialops.py
                                      initializer=self.placement.with_(quiet, self._priorities.enlist, serial_here))
        # Never lowered (its threads start from the copy or training thread): takes the writes while the
        # lowered ones are behind and the kernel refused to raise them (ThreadPriorities.boost).
        self._boost = ThreadPoolExecutor(workers, thread_name_prefix=f"fastckpt-boost-{n}",
                                         initializer=self.placement.with_(quiet, serial_here))
        self._copy_q: queue.Queue[Job | None] = queue.Queue()
        self._commit_q: queue.Queue[Any] = queue.Queue()
        self._copier = threading.Thread(target=self._copy_loop, name=f"fastckpt-copy-{n}", daemon=True)
        self._committer = threading.Thread(target=self._commit_loop, name=f"fastckpt-commit-{n}", daemon=True)
        self._checker = StagedChecker(f"fastckpt-crc-{n}", self.placement.with_(quiet))  # shm: staged bytes' CRCs
        self._copier.start()
        self._committer.start()
        self._closed = False
        # Called at the seal with a refused snapshot's error (staging.on_mutation "raise"): the owner records it.
        self.on_refused: Callable[[Job, BaseException], None] | None = None
        # staging.crc_in_copy: the copy thread checksums what it stages (engine/onepass.py); staging.compiled_pass:
        # in one compiled call a shard (format/fused.py). Off unless a Saver hands its config's options over.
        self.staging = StagingOptions(crc_in_copy=False, compiled_pass="off")
        self.pacer: WritePacer | None = None  # persist.pace_writes (engine/writepace.py)
        self._on_gpu = False  # the newest job's state is on a GPU: training then keeps one CPU busy, not torch's threads
        self.gate = CpuGate(None)  # persist.cpu_threads (engine/cpugate.py): auto until the config says otherwise
        self.cpu_threads("auto")
        if hasattr(storage, "cpu_section"):  # local buffered writes (the kernel's copy) pass the gate too
            storage.cpu_section = self.gate.held

    def cpu_threads(self, limit: int | str) -> None:
        """``persist.cpu_threads``: ``auto`` or a fixed number of CPU-bound background sections at once."""
        self.gate.limit = (lambda: auto_limit(self._on_gpu)) if limit == "auto" else limit

    # ---- called by the Checkpointer on the training thread -------------------------

    def stage_now(self, job: Job, shards: list[Shard]) -> None:
        """Copy ``shards`` now (eager tensors; CUDA ones are queued on the eager streams) and queue their writes.

        With shared memory, the CRCs of shards whose CUDA copies are in flight are left to the copy thread
        (``job.unchecked``): waiting here for the GPU to drain would stall the training thread inside ``save()``."""
        for shard in shards:
            self._copy_shard(job, shard, job.cuda.eager if job.cuda is not None else None)
            if job.slot.dir is not None:
                if shard_events(job.shard_events, shard.index):
                    job.unchecked.append(shard)  # save() must not wait for the GPU: the copy thread checks it
                else:
                    check_staged(job, shard)

    def submit(self, job: Job, lazy: list[Shard]) -> None:
        """Queue ``job``: the copy thread stages ``lazy`` shards, then the committer commits."""
        self._on_gpu = job.cuda is not None
        job.fused = fused.kernel(self.staging.compiled_pass, job.plan.total_bytes)  # where ready: never waits
        submitted(job)  # a device snapshot: the next one waits for these copies (engine/cudastage.py)
        cpus, job.cpu_section = self.placement.want(), self.gate.held  # CPUs resolved here, moved to by the copy thread
        if lazy and not snapshotted(job):  # a device snapshot holds save()'s values: nothing to guard or seal
            # Still in save(), on the training thread: the snapshot's counters. The order is made once per plan.
            order = LazyOrder.of(job.plan.memo, lazy)
            job.guard = VersionGuard(job.handle.name, job.version_src or job.tensors, job.keys, order)
            job.seal = Seal(job.guard, job.tensors, job.keys, order.entries, reuse=(job.token, job.plan))
            job.handle.needs_seal(lambda: self._seal(job))
        else:
            job.handle.sealed_now()
        self._commit_q.put(job)
        if lazy or (job.unchecked and job.error is None):
            self._copy_q.put((job, lazy, cpus))  # type: ignore[arg-type]
        else:
            self.placement.place(cpus)
            self._mark_staged(job)

    def submit_recovered(self, job: Job) -> None:
        """Persist a snapshot adopted from shared memory: its bytes are already staged."""
        job.handle.mark_staged()
        job.handle.sealed_now()
        for shard in job.plan.mine(job.plan.shards):
            job.writes.append(self._writers().submit(self._write_shard, job, shard))
        self._commit_q.put(job)

    def run_in_order(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the committer after every job submitted so far (deletions)."""
        fut: Future = Future()
        self._commit_q.put((fn, fut))
        return fut

    def close(self, timeout: float | None = None) -> bool:
        """Stop all threads after they drain their queues; idempotent. False if ``timeout`` expired
        first: a stalled write still holds a thread, which is left to finish or fail on its own."""
        if self._closed:
            return True
        self._closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        self._copy_q.put(None)
        self._commit_q.put(None)
        if self.pacer is not None:
            self.pacer.close()
        for thread in (self._copier, self._committer):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        drained = not (self._copier.is_alive() or self._committer.is_alive())
        self._io.shutdown(wait=drained, cancel_futures=not drained)
        self._boost.shutdown(wait=drained, cancel_futures=not drained)
        if drained:
            self._checker.close()
        return drained

    # ---- copy thread ---------------------------------------------------------------

    def _copy_loop(self) -> None:
        # Normal priority: the next optimizer step waits for it (starved, overlap turns into a stall); writes can yield
        quiet()  # signals go to the training thread (engine/threadsignals.py)
        self.placement.enlist()
        serial_here()  # its copies and reductions never fan out onto the training thread's core
        while True:
            item = self._copy_q.get()
            if item is None:
                return
            job, shards, cpus = item  # type: ignore[misc]
            self.placement.place(cpus)  # off the CPU save() ran on (resolved there), before this thread copies
            try:
                if job.cuda is not None:
                    job.cuda.begin_lazy()
                for shard in shards:
                    self._copy_shard(job, shard, job.cuda.lazy if job.cuda is not None else None,
                                     self.staging.crc_in_copy)
                # shm: every copy queued first, then checksummed as they land (engine/stagedcheck.py); job.unchecked
                # were queued in save(), so mostly landed by now: the lazy copies above were not held behind them
                if job.slot.dir is not None:  # CPU-bound on a CPU state (CUDA: it waits for the copies first)
                    with self.gate.held(urgent=True) if job.cuda is None else nullcontext():
                        self._checker.check(job, [s for s in shards if s.index not in job.staged_crcs]
                                            + job.unchecked)
            except BaseException as e:  # noqa: BLE001 - reported through the job
                job.error = e
            finally:
                job.handle.track_copies([] if snapshotted(job) else [(d, ev) for (_, d), ev in job.shard_events.items()])
                if job.cuda is None:  # CUDA copies are only queued here: timed when seen done (_write_shard)
                    job.handle.stats.staging_ms = (time.perf_counter() - job.t0) * 1e3
                self._mark_staged(job)
                record_staged(job)

    def _mark_staged(self, job: Job) -> None:
        """Release ``wait_staged()``; with shared memory, only once the snapshot's record is in place, so
        every snapshot staged before a crash is recoverable."""
        if job.error is None and job.guard is not None:
            try:
                job.guard.check_all()  # a write that raced a copy has bumped its counter by now
            except BaseException as e:  # noqa: BLE001 - reported through the job
                job.error = e
        shm = self._arena.shm
        if job.error is None and job.slot.dir is not None and not job.slot.recovered and shm is not None:
            try:
                shm.write_record(job)
            except BaseException as e:  # noqa: BLE001 - reported through the job
                job.error = e
        job.handle.mark_staged()

    def _seal(self, job: Job) -> Callable[[], None] | None:
        """The seal of ``job`` (``SaveHandle.seal``, on the training thread): engine/sealing.py's ``seal_job``."""
        return seal_job(job, self.on_refused)

    def _copy_shard(self, job: Job, shard: Shard, streams: dict[int, Any] | None, crc: bool = False) -> None:
        """The copy thread's CPU copy is one of the CPU-bound sections (engine/cpugate.py); a CUDA copy is only
        queued, and save()'s eager copies on the training thread never wait. The gate is taken after the buffer: in
        ring mode the buffer waits for an I/O worker's write to free it, and that worker may wait for the gate."""
        buf = job.slot.buffer(shard)
        gated = streams is None and threading.current_thread() is self._copier
        with self.gate.held(urgent=True) if gated else nullcontext():
            self._copy_into(job, shard, buf, streams, crc)
        job.writes.append(self._writers().submit(self._write_shard, job, shard))

    def _copy_into(self, job: Job, shard: Shard, buf: torch.Tensor, streams: dict[int, Any] | None,
                   crc: bool) -> None:
        # The one pass (copy thread only: inside save() it would lengthen the call; not once training waits for
        # staging), or a batched plain copy on a serial thread (engine/onepass.py); else tensor by tensor below
        if streams is not None:
            queue_shard(job, shard, buf, streams)  # a few torch calls a device (engine/cudastage.py)
        elif not stage_batched(job, shard, buf, crc and job.file_format is OPEN_LAYOUT):
            # The guard knows only the lazy tensors: eager shards (copied inside save()) pass through unchecked.
            copy_entries(buf, shard.entries if job.guard is None else job.guard.around(shard.entries), job.tensors)
        for e in shard.entries if streams is not None or job.seal is None else ():  # else dropped by the seal
            job.tensors[e.index] = None  # queued (job.cuda.kept holds a CUDA source until copied): drop it now
        if job.seal is not None and shard.lazy:
            if streams is not None and not job.slot.ring:
                job.to_record.append(shard)  # CUDA: sampled once every copy is queued (sealing.record_staged)
            else:  # the staged bytes the seal compares, taken while the buffer is ours (ring mode reuses it)
                host_wait(shard_events(job.shard_events, shard.index))
                job.seal.record(buf, shard.entries)

    def _writers(self) -> ThreadPoolExecutor:
        return self._boost if self._priorities.boost else self._io

    # ---- I/O workers -----------------------------------------------------------------

    def _write_shard(self, job: Job, shard: Shard) -> ShardResult:
        fmt = job.file_format
        try:
            if landed(job, shard):  # blocking events: this worker sleeps until the DMA has filled the buffer
                job.copied_at[shard.index] = time.perf_counter()
            buf = job.slot.held(shard)
            if job.health is not None and shard.index not in job.staged_health:  # else the copy thread's pass took
                with self.gate.held():  # them; on the staged copy, never on the training thread; + CRC32C, CPU-bound
                    job.health.update(shard_stats(job, shard, buf, fmt))  # CUDA: the device's figures, if taken
            if fmt.keeps_shards:  # a format that writes at the commit: here it only checksums (and hashes)
                with self.gate.held():
                    return fmt.write_shard(self.storage, job, shard, memoryview(buf.numpy())[: shard.nbytes])
            if self.pacer is None:
                return fmt.write_shard(self.storage, job, shard, memoryview(buf.numpy())[: shard.nbytes])
            self.pacer.take(shard.nbytes)
            t0 = time.monotonic()
            result = fmt.write_shard(self.storage, job, shard, memoryview(buf.numpy())[: shard.nbytes])
            self.pacer.measured(shard.nbytes, time.monotonic() - t0)
            return result
        except BaseException as e:
            # Ring mode: the copier may be waiting for this very buffer; it must learn the snapshot is lost.
            err = StorageError(f"checkpoint {job.handle.name!r} at {job.handle.path} failed: {e}")
            err.__cause__ = e
            job.slot.fail(err)
            raise
        finally:
            if not fmt.keeps_shards:
                job.slot.release(shard)  # written or failed: the buffer may take the next bytes either way

    # ---- committer -----------------------------------------------------------------

    def _commit_loop(self) -> None:
        quiet()
        self._priorities.enlist()
        self.placement.enlist()
        while True:
            item = self._commit_q.get()
            if item is None:
                return
            if isinstance(item, tuple):
                fn, fut = item
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller's future
                    fut.set_exception(e)
                continue
            self._finish(item)

    def _finish(self, job: Job) -> None:
        try:
            results = self._written(job)
            job.handle.stats.written_bytes = sum(r[1].size for r in results)  # this rank's share
            if job.shared is not None:
                info = self._commit_shared_file(job, results, None)
            elif self._coord is None:
                info = self._commit(job, results)
            else:
                info = self._commit_together(job, results, None)
        except BaseException as e:  # noqa: BLE001 - every failure becomes the job's error
            if self._coord is not None and not getattr(e, "_fastckpt_agreed", False):
                # This rank failed before the protocol: it still takes part, reporting its
                # error, so no rank hangs. The verdict is then a failure that we already hold.
                try:
                    if job.shared is not None:
                        self._commit_shared_file(job, [], e)
                    else:
                        self._commit_together(job, [], e)
                except BaseException as agreed:  # noqa: BLE001 - the local error ``e`` is the one to raise
                    if job.shared is not None:
                        e = agreed  # the same verdict on every rank, naming the failing rank (``e`` chained)
            try:
                all_landed(job)  # never recycle a buffer a DMA may still be writing; the sources it read may go
            except BaseException as cuda_err:  # noqa: BLE001 - the handle must still fail and the slot free
                # A failed event wait is a sticky CUDA error: the context runs no more copies, so no DMA can still
                # write the slot. Raising here left the handle pending and the slot busy, and close() hung.
                log.warning("fastckpt: waiting for the CUDA copies of failed checkpoint %r failed too: %s",
                            job.handle.name, cuda_err)
            for f in job.writes:
                if not f.done():
                    f.exception()
            self._discard(job)
            err = e if isinstance(e, FastCkptError) else StorageError(
                f"checkpoint {job.handle.name!r} at {job.handle.path} failed: {e}")
            if err is not e:
                err.__cause__ = e
            job.handle.stats.persist_s = time.perf_counter() - job.t0
            if job.retaken:  # taken again under the same handle: nothing to report, the retake resolves it
                self._release(job)
                job.cleared.set()
                return
            self._on_failure(job, err)
            self._release(job)  # after the error is recorded: a save() waiting for this slot raises it
            job.cleared.set()
            job.handle.set_failed(err)
            return
        self._release(job, committed=True)
        job.cleared.set()
        job.handle.stats.persist_s = time.perf_counter() - job.t0
        self._on_commit(job, info)
        job.handle.set_committed(info)

    await_seal = staticmethod(await_seal)  # the persister pipeline's committer calls it too

    def _written(self, job: Job) -> list[ShardResult]:
        self.await_seal(job)
        if job.error is not None:
            raise job.error
        results = [f.result() for f in job.writes]
        if job.copied_at:  # CUDA: staged when the last copy was seen done, not when it was queued
            job.handle.stats.staging_ms = (max(job.copied_at.values()) - job.t0) * 1e3
        return results

    def _commit_together(self, job: Job, results: list[Any], error: BaseException | None) -> CheckpointInfo:
        """The distributed commit: gather to rank 0, rank 0 commits, everyone learns the verdict."""
        coord = self._coord
        assert coord is not None
        merged, failed = coord.gather(results + ([HealthPart(job.health)] if job.health is not None else []), error)
        merged = measured(job, merged)  # rank 0: every rank's tensor statistics joined into job.health
        info = None
        if coord.rank == 0 and failed is None:
            try:
                info = self._commit(job, merged)
            except BaseException as e:  # noqa: BLE001 - broadcast before raising
                failed = f"rank 0 commit: {e}"
        verdict = coord.outcome(failed)
        if verdict is not None:
            err = StorageError(f"checkpoint {job.handle.name!r} at {job.handle.path} failed: {verdict}")
            err._fastckpt_agreed = True  # type: ignore[attr-defined]
            if error is not None:
                raise err from error
            raise err
        if info is None:  # ranks other than 0 did not write the manifest
            info = CheckpointInfo(job.handle.name, job.handle.step, job.dirpath, sum(r[1].size for r in results))
        return info

    def _release(self, job: Job, committed: bool = False) -> None:
        shm = self._arena.shm
        if job.slot.dir is not None and shm is not None:  # slots have folders only where the arena has shm
            if committed and job.file_format.catalogued:  # a restart may load this checkpoint from memory
                shm.mark_committed(job.slot.dir)
            elif job.slot.recovered:
                shm.remove(job.slot.dir)
            else:
                shm.clear_record(job.slot.dir)
        self._arena.release(job.slot)

    def _commit(self, job: Job, results: list[ShardResult]) -> CheckpointInfo:
        """The format publishes the checkpoint (the commit point); ``results``: every rank's written shards."""
        if job.health is not None:
            job.health_doc = summarize(job.health, len(job.health) == len(set(job.keys)))
        info, wrote = job.file_format.commit(self.storage, job, results, lambda: self._staged_views(job, results),
                                             self._writers())
        job.handle.stats.nbytes = info.nbytes
        job.handle.stats.written_bytes += wrote
        return info

    def _commit_shared_file(self, job: Job, results: list[ShardResult], error: BaseException | None) -> CheckpointInfo:
        """One torch file written by every rank (``fastckpt.engine.sharedfile``): each its own records, rank 0
        commits."""
        write = job.shared
        assert write is not None
        views, crcs = self._staged_views(job, results) if error is None else ({}, {})
        record = None if job.health is None else functools.partial(_shared_record, job, write.fmt.layout.size)
        size = write.run(views, crcs, error, self._writers(), job.health, record)  # <- rank 0 commits; all learn
        job.handle.stats.nbytes = size
        job.handle.stats.written_bytes = write.written
        return CheckpointInfo(job.handle.name, job.handle.step, write.fmt.path, size, crc32c=write.crc32c)

    def _staged_views(self, job: Job, results: list[ShardResult]) -> tuple[dict[int, memoryview], dict[int, int]]:
        """Each staged record's bytes (held in the slot until the commit) and CRC-32, by table index."""
        by_shard = {s.index: s for s in job.plan.shards}
        crcs: dict[int, int] = {}
        views: dict[int, memoryview] = {}
        for index, _, tcrcs in results:
            shard = by_shard[index]
            data = memoryview(job.slot.held(shard).numpy())
            for e, c in zip(shard.entries, tcrcs):
                crcs[e.index] = c
                views[e.index] = data[e.offset:e.offset + e.nbytes]
        return views, crcs

    def _discard(self, job: Job) -> None:
        """Remove every file this job may have written (never another save's)."""
        job.file_format.discard(self.storage, job)


def _shared_record(job: Job, size: int, tensors: dict[str, Any], digest: str | None) -> bytes:
    """Rank 0: the health record of a file every rank wrote (its extended attribute), from all ranks' statistics."""
    return attr_bytes(summarize(tensors, len(tensors) == len(set(job.keys))), job.handle.step, size, digest)
