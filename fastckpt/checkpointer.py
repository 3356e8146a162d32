"""``Checkpointer``: wires the engine and the tiers; save() -> SaveHandle, load(), latest(), retention, close()."""
from __future__ import annotations

import logging
import os
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Callable

import torch

from .config import CheckpointConfig
from .engine.devicesnap import DeviceSnapshots
from .engine.distributed import Coordinator
from .engine.exithook import register_exit_hook
from .engine.futures import raise_if_left, remaining, resolved
from .engine.handle import SaveHandle, SaveStats
from .engine.pipeline import Job
from .engine.preempt import Preemption
from .engine.prewarm import Prewarm
from .engine.priority import ThreadPriorities
from .engine.saver import Saver, WatchHandle
from .engine.staging import HostArena
from .engine.streams import CopyStreams
from .errors import CheckpointTimeoutError, ConfigError, FastCkptError
from .format.health import delete_with_record
from .format.layout import CheckpointInfo
from .format.paths import checkpoint_name, file_name
from .format.plan import Planner
from .read.loader import CheckpointReader
from .read.loadstats import LoadStats
from .read.reread import read_consistently
from .storage.protocol import Storage, open_storage
from .tiers.catalog import Catalog
from .tiers.claim import RootClaim
from .tiers.recovery import recover
from .tiers.remote import RemoteTier
from .tiers.remotesums import ChecksumStats
from .tiers.runs import Cadenced, RootCadence
from .tiers.persister import pipeline_for
from .tiers.shm import ShmTier
from .tiers.shm_load import load_from_shm
from .tiers.union import CatalogUnion

__all__ = ["Checkpointer", "WatchHandle"]

log = logging.getLogger("fastckpt")

_EXIT_FLUSH_S = 300.0  # bounded wait for pending saves at interpreter exit


class Checkpointer(Cadenced):
    """Saves nested training state asynchronously; see docs/API.md."""

    def __init__(self, config: CheckpointConfig, *, storage: Storage | None = None,
                 remote_storage: Storage | None = None, distributed: bool = False, group: Any = None) -> None:
        """``distributed=True``: every rank of ``group`` (default: world) constructs this together and
        calls ``save``/``load`` with the same replicated state; the ranks share the copies and writes.
        ``remote_storage``: the remote tier's ``Storage`` (default: opened from ``config.remote``)."""
        self._pipeline = None  # set once built: close() is safe on a half-built object
        self._uploader: RemoteTier | None = None
        self._owner_pid = os.getpid()  # a fork()ed child inherits this object but none of its threads
        self._root: RootClaim | None = None
        self._coord: Coordinator | None = None
        self._priorities: ThreadPriorities | None = None
        if not isinstance(config, CheckpointConfig):
            raise ConfigError(f"Checkpointer needs a CheckpointConfig, got {type(config).__name__}")
        config.freeze()  # read again after construction: a field changed now would leave us inconsistent
        _refuse_early(config, distributed)  # what the config alone refuses: before any thread or group starts
        self.config = config
        try:
            self._build(config, storage, remote_storage, distributed, group)
        except BaseException:
            _abandon(self)  # a constructor that raises leaves no thread, process, group or lock behind
            raise

    def _build(self, config: CheckpointConfig, storage: Storage | None, remote_storage: Storage | None,
               distributed: bool, group: Any) -> None:
        p, st, rem = config.persist, config.staging, config.remote
        self.storage, remote_storage = _open_storages(config, storage, remote_storage)
        self.remote_storage: Storage | None = remote_storage  # the remote tier, or None
        self._catalog = Catalog(self.storage)
        self._tiers = CatalogUnion(self._catalog, Catalog(remote_storage) if remote_storage is not None else None,
                                   config.retention, grace_s=config.orphan_grace_s)
        self._coord = Coordinator(group) if distributed else None
        self._shm = ShmTier.trusted(st.shm_dir, self.storage, self._coord) if st.shm else None
        self._planner = Planner(p.chunk_bytes)
        self._arena = HostArena(st.slots, st.max_host_bytes, self._shm)
        self._prewarm = Prewarm(self._arena, config.staging.compiled_pass)  # buffers made before the first save
        # per-device copy streams, created on the first CUDA save; staging.device_snapshot's device buffers
        self._streams = CopyStreams(snapshots=DeviceSnapshots(config.staging.device_snapshot))
        self.last_load_stats: LoadStats | None = None  # which tier served the last load, bytes, seconds
        self._priorities = ThreadPriorities(p.priority)  # built here: the training thread's policy is "normal"
        self._root = RootClaim(self.storage, leader=self._leader, grace_s=config.orphan_grace_s, in_flight=self.pending_names)
        self.removed_orphans = self._root.removed_orphans  # folders of dead saves removed at the first write
        self._saver = Saver(config, self.storage, planner=self._planner, arena=self._arena, streams=self._streams,
                            priorities=self._priorities, coord=self._coord, claim_root=self._root.claim,
                            uploads=remote_storage is not None and self._leader, on_commit=self._on_commit,
                            pipeline=pipeline_for(config, self.storage, self._shm, self._coord))
        self._pipeline = self._saver.pipeline
        if self._coord is not None:
            self._root.claim_together(self._coord)
        if remote_storage is not None and self._leader:  # rank 0 uploads for everyone
            self._uploader = self._tiers.start_uploads(
                workers=rem.workers, keep_last=rem.keep_last, priorities=self._priorities, dedup=rem.dedup,
                run_in_order=self._after_saves, pending=self.pending_names, on_failed=self._saver.record_error)
        self.cadence = RootCadence(config.cadence, self.storage, self._coord, self._root.claim, self._after_saves)
        self._atexit = _exit_flusher(self)
        register_exit_hook(self._atexit)
        self.recovered: list[SaveHandle] = [] if not st.shm else recover(
            self._shm, self._coord, self._root.claim, self._saver.submit_recovered)
        # what a previous process committed but never uploaded (the recovered ones' uploads were queued already)
        self.resumed_uploads: list[SaveHandle] = [] if self._uploader is None else self._tiers.resume_uploads(
            {h.name for h in self.recovered}, lambda i: self._saver.new_handle(i.name, i.step, i.path, i.nbytes))
        self.preemption = Preemption(config.preemption, self)  # on_preempt(), point(): see engine/preempt.py

    # ---- saving (engine/saver.py) ----------------------------------------------------

    def watch(self, optimizer: torch.optim.Optimizer, *, hook: bool = True) -> WatchHandle:
        """Mark ``optimizer``'s params and state as lazily copyable; with ``hook``, its step() waits for staging."""
        return self._saver.watch(optimizer, (lambda: self.preemption.before_step(self.wait_staged)) if hook else None)

    def save(self, state: Any, step: int, *, name: str | None = None, eager: Any = (), lazy: Any = ()) -> SaveHandle:
        """Snapshot ``state``; returns once eager tensors are copied (milliseconds).

        ``eager``: tensors, or fnmatch patterns of their keys, copied inside ``save()`` even though a watched
        optimizer owns them (written in place before the next ``step()``: an embedding's ``max_norm``, an EMA swap).
        ``lazy``: tensors nothing writes before the next ``step()`` although no watched optimizer owns them (frozen
        or LoRA base weights), copied in the background too."""
        self._check_open()
        return self._saver.save(state, step, name=name, eager=eager, lazy=lazy)

    def save_file(self, state: Any, name: str, *, step: int = 0, kind: str = "torch") -> SaveHandle:
        """Snapshot ``state`` as one torch checkpoint file ``root/name`` (or ``root/folder/name``): the file
        ``torch.save`` writes (``kind="safetensors"``: ``safetensors.torch.save_file``'s). Returns once the eager
        storages are copied; the file appears under its name only once complete and durable. Retention does not
        apply: the caller (a framework such as Lightning) decides which files to keep. With ``distributed=True``
        the ranks share the writes of the one file: see ``Saver.save_file``."""
        self._check_open()
        return self._saver.save_file(state, name, step=step, kind=kind)

    def save_files(self, files: dict[str, tuple[str, Any]], name: str, *, step: int = 0, user: dict | None = None,
                   made: bool = False, loaders: dict[str, Any] | None = None, staged: bool = False) -> SaveHandle:
        """Snapshot a framework's checkpoint folder ``root/name`` as one save, ``manifest.json`` written last (the
        commit): ``files`` maps each file name to ``("safetensors", {key: tensor})`` or ``("torch", obj)``. Like
        ``save_file``: no root lock, no retention, one process. See ``Saver.save_files`` for the keyword arguments;
        ``staged`` (with ``made``): written in ``staging_path(root/name)``, renamed to ``root/name`` once committed."""
        self._check_open()
        return self._saver.save_files(files, name, step=step, user=user, made=made, loaders=loaders, staged=staged)

    def remove_file(self, name: str) -> Future:
        """Delete the file ``root/name`` after every save submitted before (Lightning's ``remove_checkpoint``); missing
        is fine. The ``Future`` carries its error."""
        self._check_open()
        path = self.storage.join(self.storage.url, file_name(name))  # and its health sidecar (format/health.py)
        return self._saver.pipeline.run_in_order(lambda: delete_with_record(self.storage, path))

    def prewarm(self, state: Any, *, eager: Any = (), lazy: Any = ()) -> Future:
        """Make ``state``'s staging buffers now, in the background (page-locked on CUDA), so that the first save()
        costs what later ones do; the Future gives the bytes made once they exist, and once the compiled pass
        (``staging.compiled_pass``, format/fused.py) is ready or known to be unavailable (engine/prewarm.py)."""
        self._check_open()
        if self._coord is not None:  # mine() needs the shards' owners, which the ranks agree at the first save
            raise ConfigError("prewarm() with distributed=True: the first save makes the buffers")
        return self._prewarm.start(*self._saver.plan_of(state, eager=eager, lazy=lazy))

    def pending_names(self) -> list[str]:  # saves submitted, not yet committed or failed, oldest first
        return self._saver.pending_names()

    def wait_staged(self, *, host: bool = False) -> None:
        """Block until every pending snapshot's copies are queued; see ``SaveHandle.wait_staged``."""
        if self._in_owner():  # a fork()ed child: the parent's copies are not this process's to wait for
            self._saver.wait_staged(host=host)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed (and uploaded, with a remote tier); raises a
        background error once, else ``CheckpointTimeoutError`` naming what is still pending after ``timeout``."""
        if not self._in_owner():
            return  # a fork()ed child: the parent's saves are not this process's to wait for
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = self._flush("wait() blocks on it", timeout)
        uploads = self._tiers.wait_uploads(deadline, self._after_saves)
        self._saver.raise_pending()
        raise_if_left([f"save {h.name!r}" for h in pending if not h.durable.done()] + uploads, timeout)

    def _flush(self, why: str, timeout: float | None) -> list[SaveHandle]:
        """Wait (at most ``timeout``) for the saves pending now (returned), their threads at the caller's priority."""
        self._saver.seal_all()  # a lazy save commits only once sealed (fastckpt/engine/seal.py)
        pending = self._saver.pending()
        if pending or self._tiers.uploads_left():  # the upload threads are lowered too
            self._priorities.waiting(why)
        wait_futures([h.durable for h in pending], timeout)
        return pending

    # ---- background callbacks (committer and upload threads) --------------------------

    def _on_commit(self, job: Job, info: CheckpointInfo) -> None:
        self._saver.stale.committed(job)  # parameters unchanged across optimizer steps: warned once
        if not job.file_format.catalogued:  # a framework's file (save_file): not in the catalog, retention or remote
            self._saver.settle(job.handle)
            return
        self._tiers.committed(info, job.handle)
        self._saver.settle(job.handle)
        self._apply_retention()

    def _after_saves(self, fn: Callable[[], None]) -> Future | None:
        """Run ``fn`` on the committer after every save submitted so far; nothing once closing began."""
        pipeline = self._pipeline
        return pipeline.run_in_order(fn) if pipeline is not None else None

    def _apply_retention(self) -> None:
        if self._leader:
            self._tiers.retain(set(self.pending_names()))

    # ---- committed checkpoints (tiers/union.py) ------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints under ``root`` and on the remote tier (the local copy first), oldest step first."""
        self._check_open()
        return self._tiers.list()

    def latest(self, *, healthy: bool = False) -> int | None:
        """Newest committed step, or None; ``healthy=True``: the newest whose tensors hold no NaN or Inf."""
        return max((i.step for i in self.list() if i.healthy or not healthy), default=None)

    def exists(self, name: str) -> bool:  # a checkpoint named ``name`` is committed (locally or on the remote tier)
        return self._tiers.exists(checkpoint_name(name))

    def reader(self, step: int | None = None, *, name: str | None = None) -> CheckpointReader:
        """A reader for one committed checkpoint (the latest by default); the local copy when there is
        one, else the remote tier's."""
        self._check_open()
        return self._open_reader(*self._locate(step, name))

    def _locate(self, step: int | None, name: str | None, healthy: bool = False) -> tuple[Storage, str]:
        storage, target = self._tiers.locate(step, None if name is None else checkpoint_name(name), healthy)
        return storage, storage.join(storage.url, target)

    def _open_reader(self, storage: Storage, dirpath: str) -> CheckpointReader:
        if self._coord is not None:  # a distributed load's collectives come after every pending commit's, on every rank
            self._saver.drain()
        return CheckpointReader(storage, dirpath, verify=self.config.persist.verify_on_load,
                                workers=self.config.persist.workers, allowed_classes=self.config.allowed_classes,
                                coord=self._coord, strategy=self.config.read.strategy, remember=True)

    def _read(self, step: int | None, name: str | None, use: Callable[[CheckpointReader], Any],
              shm: Callable[[CheckpointReader], Any] | None = None, healthy: bool = False) -> Any:
        """``use`` a reader (``shm``: a load from the shared-memory tier, nearest first), again if replaced meanwhile."""
        self._check_open()
        storage, dirpath = self._locate(step, name, healthy)  # healthy: the newest without NaN/Inf (tiers/union.py)

        def run() -> Any:
            reader = self._open_reader(storage, dirpath)
            done = shm(reader) if shm is not None and self._shm is not None else None
            if done is not None:
                self.last_load_stats = done[1]
                out = done[0]
            else:
                out = use(reader)
                self.last_load_stats = reader.stats
            self.cadence.loaded(reader.step)  # a rollback replays steps already saved: should_save counts from it
            return out

        with self._tiers.explaining(storage, dirpath, self.config.root):  # damaged: what it lacks, what loads
            # ranks read together (self._coord): one retrying alone would hang the others
            return run() if self._coord is not None else read_consistently(storage, dirpath, run)

    def load(self, step: int | None = None, *, name: str | None = None, map_location: Any = None,
             healthy: bool = False) -> Any:
        """Rebuild a saved state (the latest committed by default, or with ``healthy`` the latest without NaN/Inf);
        tensors on CPU unless ``map_location``."""
        from_shm = None if map_location is not None else lambda reader: load_from_shm(self._shm, reader)
        return self._read(step, name, lambda reader: reader.load(map_location), from_shm, healthy)

    def load_into(self, target: Any, step: int | None = None, *, name: str | None = None,
                  healthy: bool = False) -> Any:
        """Copy a saved state into ``target``'s tensors in place (after pending lazy copies have read them)."""
        self.wait_staged()
        return self._read(step, name, lambda reader: reader.load_into(target),
                          lambda reader: load_from_shm(self._shm, reader, target), healthy)

    def delete(self, name: str) -> Future:
        """Delete a committed checkpoint (both copies, with a remote tier) after every save (and upload)
        submitted before this call."""
        self._check_open()
        name = checkpoint_name(name)
        if not self._leader:
            return resolved(None)  # rank 0 deletes for everyone
        self._root.claim()
        return self._tiers.delete(name, self._saver.pipeline.run_in_order)

    def upload(self, name: str) -> Future:
        """Upload the locally committed checkpoint ``name`` to the remote tier (again), after every save
        submitted before this call: the retry after an upload failure, or for a checkpoint committed by a
        process that died before uploading it. The ``Future`` resolves to the remote ``CheckpointInfo``;
        its error is raised only through it."""
        self._check_open()
        name = checkpoint_name(name)
        if self._tiers.remote is None:
            raise ConfigError("Checkpointer.upload() needs a remote tier: set remote.url in the config")
        return self._tiers.upload(name, self._saver.pipeline.run_in_order)

    # ---- lifecycle -----------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        """Whether the ranks of a process group share this Checkpointer's saves (``distributed=True``)."""
        return self._coord is not None

    @property
    def _leader(self) -> bool:
        return self._coord is None or self._coord.rank == 0

    @property
    def stats(self) -> list[SaveStats]:
        """The figures of every finished save (committed or skipped), oldest first."""
        return self._saver.stats

    @property
    def upload_checksums(self) -> ChecksumStats | None:  # what the store verified of the uploads (rank 0)
        return None if self._uploader is None else self._uploader.checksums

    @property
    def counters(self) -> dict[str, int]:
        """Plan-cache and arena counters: a steady-state loop keeps them constant."""
        return {"plans_built": self._planner.plans_built, "host_allocations": self._arena.allocations,
                "host_bytes": self._arena.allocated_bytes}

    def _check_open(self) -> None:
        if self._pipeline is None:
            raise FastCkptError("this Checkpointer is closed; create a new one")
        if not self._in_owner():
            raise FastCkptError(f"this Checkpointer belongs to process {self._owner_pid}; a fork()ed child (pid "
                                f"{os.getpid()}) has none of its threads: create a new Checkpointer in the child")

    def _in_owner(self) -> bool:
        return getattr(self, "_owner_pid", None) in (None, os.getpid())

    def close(self, timeout: float | None = None) -> None:
        """Flush pending saves, stop the threads, free staging memory; raise a background error once. A preemption
        signal caught since the last safe point has its final checkpoint taken first and goes on last."""
        preemption = getattr(self, "preemption", None)  # None on a half-built object
        if preemption is not None and getattr(self, "_pipeline", None) is not None:
            preemption.finish()  # while saves are still accepted (engine/preempt.py)
        pipeline, self._pipeline = getattr(self, "_pipeline", None), None
        if pipeline is None:
            return
        try:
            if self._in_owner():  # a fork()ed child only forgets the parent's saves: flushing them would wait forever
                _shut_down(self, pipeline, timeout)
        finally:
            if preemption is not None:
                preemption.close()  # every signal caught goes on once flushed: it may end the process here

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            self.close()
        except FastCkptError as e:
            if exc_type is None:
                raise
            log.error("fastckpt: while closing after an error: %s", e)  # don't mask the exception in flight

    def __del__(self) -> None:
        if getattr(self, "_pipeline", None) is not None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - nothing can be raised from __del__
                pass


def _refuse_early(config: CheckpointConfig, distributed: bool) -> None:
    """What the config alone refuses, refused before a constructor starts anything."""
    Preemption.check_installable(config.preemption)  # signal handlers: the main thread only
    if distributed and config.staging.when_busy == "skip":
        # ranks deciding to skip independently would leave the commit protocol waiting on each other
        raise ConfigError("staging.when_busy=skip cannot be used with distributed=True (ranks could disagree); use wait")


def _abandon(ckpt: Checkpointer) -> None:
    """Undo a constructor that raised: stop the threads, uploads, persister and process group it started and
    release the root. Nothing was saved by the caller yet; an error here is logged, the constructor's raised."""
    try:
        if ckpt._pipeline is not None:
            ckpt.close()  # copy, commit and upload threads, the persister, the private group, the root's lock
            return
        if ckpt._coord is not None:
            ckpt._coord.close()
        if ckpt._priorities is not None:
            ckpt._priorities.close()
    except Exception as e:  # noqa: BLE001 - the constructor's own error is the one to raise
        log.warning("fastckpt: while undoing a Checkpointer that could not be built: %r", e)


def _shut_down(ckpt: Checkpointer, pipeline: Any, timeout: float | None) -> None:
    """``Checkpointer.close`` in the process that owns it: flush, stop every thread, release the root."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = ckpt._flush("close() flushes it", timeout)
    ckpt._prewarm.close()  # before the arena drops the buffers it is making
    ckpt._saver.unwatch_all()
    drained = pipeline.close(remaining(deadline))
    stuck = [f"save {h.name!r}" for h in pending if not h.durable.done()] + ckpt._tiers.uploads_left()
    uploader = ckpt._uploader
    if uploader is not None:
        uploader.close(remaining(deadline))  # flush the uploads (bounded), then stop its threads
        if ckpt.config.retention.keep_last is not None and drained:
            ckpt._apply_retention()  # what was kept only for a pending upload
        ckpt._uploader = None
    ckpt._priorities.close()
    if drained:
        if ckpt._coord is not None:
            ckpt._coord.close()  # every commit is done: its private group's threads can be joined
        ckpt._arena.close()  # else a stalled writer still reads its slot: the buffers go with the process
        ckpt._streams.snapshots.close()  # staging.device_snapshot's device buffers, back to torch's allocator
        if hasattr(ckpt, "cadence"):  # not on a half-built object
            ckpt.cadence.end()  # a clean end in the root's record of runs: this run did not fail
        ckpt._root.release()  # after the last commit and retention: the next writer may start
        ckpt._saver.raise_pending()
        return
    # Timed out: the lock stays held (a stalled save may still commit into the root until this process exits).
    err = _timed_out(timeout, stuck)
    log.warning("fastckpt: %s", err)  # a background error, if any, is raised first
    ckpt._saver.raise_pending()
    raise err


def _timed_out(timeout: float | None, stuck: list[str]) -> CheckpointTimeoutError:
    return CheckpointTimeoutError(
        f"Checkpointer.close(timeout={timeout}) expired with {', '.join(stuck) or 'queued deletions'} still "
        "pending: the storage stalled. The previous committed checkpoint is intact; this one may still commit "
        "or fail in the background (an fsspec storage gives up after network.timeout_s)")


def _open_storages(config: CheckpointConfig, storage: Storage | None,
                   remote: Storage | None) -> tuple[Storage, Storage | None]:
    """The root's storage and the remote tier's (None without one), opened from ``config`` unless given."""
    p, rem = config.persist, config.remote
    storage = storage or open_storage(config.root, config.storage_options, direct_io=p.direct_io, fsync=p.fsync,
                                      workers=p.workers, network=config.network)
    _check_storage(storage, "root")
    if remote is None and rem.url is not None:
        remote = open_storage(rem.url, rem.storage_options, workers=rem.workers, network=config.network)
    if remote is not None:
        _check_storage(remote, "remote.url")
    return storage, remote


def _check_storage(storage: Storage, what: str) -> None:
    """The one cheap probe at construction: a typo'd bucket or an unwritable root fails now, not at resume."""
    check = getattr(storage, "check", None)
    if check is not None:
        check(what)


def _exit_flusher(ckpt: Checkpointer) -> Any:
    ref = weakref.ref(ckpt)

    def flush() -> None:
        obj = ref()
        if obj is None or obj._pipeline is None:
            return
        n = len(obj.pending_names()) + (len(obj._uploader.pending_futures()) if obj._uploader is not None else 0)
        if n:
            log.warning("fastckpt: interpreter exiting, flushing %d pending checkpoint(s) (up to %.0fs)", n, _EXIT_FLUSH_S)
        try:
            obj.close(timeout=_EXIT_FLUSH_S)
        except Exception as e:  # noqa: BLE001 - report, never raise at exit
            log.error("fastckpt: pending checkpoint failed at exit: %s", e)

    return flush
