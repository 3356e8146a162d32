"""``Checkpointer``: save() -> SaveHandle, load(), latest(), retention, close()."""
from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import pickle
import re
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Callable, Iterable

import torch

from .catalog import Catalog
from .codec import dumps_objects
from .distributed import Coordinator
from .config import CheckpointConfig
from .errors import (CheckpointNotFoundError, CheckpointTimeoutError, ConfigError, FastCkptError, StateMismatchError,
                     StorageError)
from .exithook import register_exit_hook
from .gc import collect_quietly
from .lock import RootLock
from .handle import CheckpointInfo, SaveHandle, SaveStats
from .loader import CheckpointReader
from .loadstats import LoadStats
from .shm_load import load_from_shm
from .pipeline import Job, Pipeline
from .reread import read_consistently
from .plan import FlatState, Planner, flatten
from .priority import ThreadPriorities
from .futures import settle
from .remote import RemoteTier, Upload
from .staging import HostArena, Slot
from .streams import CopyStreams, CudaCopy, cuda_devices, gpu_wait
from .recovery import recoverable
from .shm_record import StagedRecord
from .tiers import ShmTier
from .storage import Storage, open_storage
from .paths import is_plain_name
from .bundle import FileBundle
from .sharedfile import can_share
from .torchfile import TorchFileFormat

__all__ = ["Checkpointer", "WatchHandle"]

log = logging.getLogger("fastckpt")

_NAME_RE = re.compile(r"^[^/\\\x00]+$")
_EXIT_FLUSH_S = 300.0  # bounded wait for pending saves at interpreter exit


class WatchHandle:
    """Returned by ``watch``; ``remove()`` stops watching the optimizer."""

    def __init__(self, owner: "Checkpointer", optimizer: Any, hook: Any) -> None:
        self._owner = weakref.ref(owner)
        self._optimizer = weakref.ref(optimizer)
        self._hook = hook

    def remove(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        owner, opt = self._owner(), self._optimizer()
        if owner is not None and opt is not None:
            owner._watched.discard(opt)


class Checkpointer:
    """Saves nested training state asynchronously; see docs/API.md."""

    def __init__(self, config: CheckpointConfig, *, storage: Storage | None = None,
                 remote_storage: Storage | None = None, distributed: bool = False, group: Any = None) -> None:
        """``distributed=True``: every rank of ``group`` (default: world) constructs this together and
        calls ``save``/``load`` with the same replicated state; the ranks share the copies and writes.
        ``remote_storage``: the remote tier's ``Storage`` (default: opened from ``config.remote``)."""
        self._pipeline: Pipeline | None = None  # set last: close() is safe on a half-built object
        self._uploader: RemoteTier | None = None
        self._owner_pid = os.getpid()  # a fork()ed child inherits this object but none of its threads
        self._root_lock: RootLock | None = None
        self._claimed = False  # whether this Checkpointer wrote (or is about to write) its root
        self.removed_orphans: list[str] = []  # folders of dead saves removed at the first write
        if not isinstance(config, CheckpointConfig):
            raise ConfigError(f"Checkpointer needs a CheckpointConfig, got {type(config).__name__}")
        config.freeze()  # read again after construction: a field changed now would leave us inconsistent
        self.config = config
        p = config.persist
        self.storage = storage or open_storage(config.root, config.storage_options, direct_io=p.direct_io,
                                               fsync=p.fsync, workers=p.workers, network=config.network)
        _check_storage(self.storage, "root")
        rem = config.remote
        if remote_storage is None and rem.url is not None:
            remote_storage = open_storage(rem.url, rem.storage_options, workers=rem.workers, network=config.network)
        if remote_storage is not None:
            _check_storage(remote_storage, "remote.url")
        self.remote_storage: Storage | None = remote_storage  # the remote tier, or None
        self._remote_catalog = Catalog(remote_storage) if remote_storage is not None else None
        self._planner = Planner(p.chunk_bytes)
        st = config.staging
        self._coord = Coordinator(group) if distributed else None
        if self._coord is not None and st.when_busy == "skip":
            # ranks deciding to skip independently would leave the commit protocol waiting on each other
            raise ConfigError("staging.when_busy=skip cannot be used with distributed=True (ranks could disagree); use wait")
        self._shm = self._shm_tier() if st.shm else None
        self._arena = HostArena(st.slots, st.max_host_bytes, self._shm)
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._hooks: list[WatchHandle] = []
        self._lock = threading.Lock()
        self._pending: list[SaveHandle] = []
        self._errors: list[tuple[SaveHandle, FastCkptError]] = []
        self._catalog = Catalog(self.storage)
        self._streams = CopyStreams()  # per-device copy streams, created on the first CUDA save
        self.stats: list[SaveStats] = []
        self.last_load_stats: LoadStats | None = None  # which tier served the last load, bytes, seconds
        self._priorities = ThreadPriorities(p.priority)  # built here: the training thread's policy is "normal"
        self._pipeline = Pipeline(self.storage, self._arena, p.workers, self._on_commit, self._on_failure,
                                  self._coord, priorities=self._priorities)
        self._root_lock = RootLock.for_root(self.storage.url) if self._leader else None  # rank 0 writes for all
        if self._coord is not None:
            self._claim_root_together()
        if self._remote_catalog is not None and self._leader:  # rank 0 uploads for everyone
            self._uploader = RemoteTier(self.storage, self._remote_catalog.storage, self._remote_catalog,
                                        workers=rem.workers, keep_last=rem.keep_last, priorities=self._priorities,
                                        on_uploaded=self._on_uploaded, on_failed=self._on_upload_failed)
        self._atexit = _exit_flusher(self)
        register_exit_hook(self._atexit)
        self.recovered: list[SaveHandle] = self._recover() if self._shm is not None else []
        self.resumed_uploads: list[SaveHandle] = self._resume_uploads() if self._uploader is not None else []

    def _claim_root(self, protect: Iterable[str] = ()) -> None:
        """Before this Checkpointer's first write: become the root's only writer (or raise naming the holder),
        then remove what dead writers left (``fastckpt.gc``); never the folders named in ``protect``."""
        if self._claimed or not self._leader:
            return
        if self._root_lock is not None:
            self._root_lock.acquire()
        self._claimed = True
        grace, keep = self.config.orphan_grace_s, set(protect)
        if grace is not None:  # under the lock: no live writer can be starting a save in what is removed
            self.removed_orphans = collect_quietly(self.storage, grace,
                                                   lambda name: name in keep or name in self.pending_names())

    def _claim_root_together(self) -> None:
        """Distributed: rank 0 claims the root at construction, and every rank learns whether it could."""
        assert self._coord is not None
        failed = None
        try:
            self._claim_root()
        except StorageError as e:
            failed = e
        verdict = self._coord.outcome(None if failed is None else str(failed))
        if failed is not None:
            raise failed
        if verdict is not None:
            raise StorageError(f"rank 0: {verdict}")

    def _shm_tier(self) -> ShmTier:
        coord = self._coord  # one namespace per root and rank: ranks sharing a machine never mix records
        return ShmTier(self.config.staging.shm_dir, self.storage.url, join=self.storage.join,
                       rank=coord.rank if coord else 0, world=coord.world if coord else 1,
                       distributed=coord is not None)

    def _recover(self) -> list[SaveHandle]:
        """Persist the snapshots a crashed process had staged in shared memory, and return once they are
        committed (or failed), so that ``latest()`` and ``load()`` already see them."""
        shm = self._shm
        assert shm is not None
        with shm.recovering():
            found = list(recoverable(shm, self._coord))
            if found:
                self._claim_root({rec.name for rec, _ in found})  # persisting them writes into the root
            handles = [self._submit_recovered(rec, slot) for rec, slot in found]
            wait_futures([h._durable for h in handles])  # a failure is raised at the next save/wait/close
        return handles

    def _submit_recovered(self, rec: StagedRecord, slot: Slot) -> SaveHandle:
        log.warning("fastckpt: recovering %s, staged in shared memory by a crashed process", rec.label)
        handle = SaveHandle(name=rec.name, step=rec.step, path=rec.dirpath,
                            stats=SaveStats(step=rec.step, name=rec.name), _on_error_seen=self._mark_seen,
                            _upload=Future() if self._uploader is not None else None)
        job = Job(handle, rec.plan, slot, [], rec.keys, rec.numpy, rec.tree, rec.objects, rec.dirpath,
                  time.perf_counter(), uid=rec.uid, dtensors=rec.dtensors, staged_crcs=rec.crcs)
        with self._lock:
            self._pending.append(handle)
        self._pipeline.submit_recovered(job)  # type: ignore[union-attr]
        return handle

    def _resume_uploads(self) -> list[SaveHandle]:
        """Upload the local checkpoints a previous process committed but never uploaded (it died, or its
        uploads failed): those newer than the newest remote one. Older local ones missing remotely were
        pruned there by ``remote.keep_last``, or predate the tier; ``upload(name)`` sends them."""
        assert self._uploader is not None and self._remote_catalog is not None
        try:
            remote = self._remote_catalog.list()
        except FastCkptError as e:
            log.warning("fastckpt: cannot list the remote tier at %s, so local checkpoints that were never "
                        "uploaded are not resumed now (Checkpointer.upload(name) sends one): %s",
                        self._remote_catalog.storage.url, e)
            return []
        newest = max((i.step for i in remote), default=None)
        handles = []
        recovered = {h.name for h in self.recovered}  # their uploads were queued when they committed
        for info in self._catalog.list():
            if (newest is not None and info.step <= newest) or info.name in recovered:
                continue
            log.warning("fastckpt: checkpoint %r (step %d) is committed under %s but not on the remote tier; "
                        "uploading it now", info.name, info.step, self.storage.url)
            handle = SaveHandle(name=info.name, step=info.step, path=info.path,
                                stats=SaveStats(step=info.step, name=info.name, nbytes=info.nbytes),
                                _on_error_seen=self._mark_seen, _upload=Future())
            handle._staged.set()
            handle._durable.set_result(info)  # committed locally long ago: only the upload is pending
            self._uploader.submit(info.name, info.path, handle._upload, handle)
            handles.append(handle)
        return handles

    # ---- saving ----------------------------------------------------------------------

    def watch(self, optimizer: torch.optim.Optimizer, *, hook: bool = True) -> WatchHandle:
        """Mark ``optimizer``'s params and state as lazily copyable; with ``hook``, its step() waits for staging."""
        handle = None
        if hook:
            handle = optimizer.register_step_pre_hook(lambda *_: self.wait_staged())
        self._watched.add(optimizer)
        wh = WatchHandle(self, optimizer, handle)
        self._hooks.append(wh)
        return wh

    def save(self, state: Any, step: int, *, name: str | None = None, eager: Any = (), lazy: Any = ()) -> SaveHandle:
        """Snapshot ``state``; returns once eager tensors are copied (milliseconds).

        ``eager``: tensors, or fnmatch patterns of their keys, copied inside ``save()`` even though a
        watched optimizer owns them (written in place before the next ``step()``: an embedding's
        ``max_norm``, an EMA swap). ``lazy``: tensors nothing writes before the next ``step()`` although
        no watched optimizer owns them (frozen or LoRA base weights), copied in the background too.
        """
        t0 = time.perf_counter()
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"save(step=...) must be a non-negative int, got {step!r}")
        name = self._check_name(name if name is not None else f"step-{step:09d}")
        self._raise_pending()
        try:
            flat = flatten(state)
        except TypeError as e:
            raise StateMismatchError(f"cannot checkpoint this state: {e}") from e
        objects = dumps_objects(flat.objects, self.config.allowed_classes, flat.object_keys) if flat.objects else None
        if self._coord is None:
            for rec in flat.dtensors:
                if rec.layout.mesh_size > 1:
                    raise ConfigError(
                        f"DTensor {rec.key!r} is sharded over {rec.layout.mesh_size} ranks, and this Checkpointer "
                        "saves alone; construct it with distributed=True on every rank (each then writes its own "
                        "blocks)")
        # After the checks of the arguments, before anything is written: a dead folder of this very name (a
        # resumed run re-saving the step it died in) is removed first, so none of its files outlive the commit.
        self._claim_root()
        lazy_ptrs = self._lazy_ptrs(_named_ptrs(flat, lazy, "lazy"), _named_ptrs(flat, eager, "eager"))
        dirpath = self.storage.join(self.storage.url, name)
        return self._submit(flat, step, name, dirpath, objects, t0, lazy_ptrs,
                            dtensors=[rec.as_json() for rec in flat.dtensors])

    def save_file(self, state: Any, name: str, *, step: int = 0) -> SaveHandle:
        """Snapshot ``state`` as one torch checkpoint file ``root/name``: the file ``torch.save(state, ...)``
        writes (its zip CRC-32 fields filled in), read back by plain ``torch.load``. Returns once the eager
        storages are copied; the file appears under its name only once complete and durable. Retention does not
        apply: the caller (a framework such as Lightning) decides which files to keep.

        With ``distributed=True``, every rank calls this with its own copy of the same data-parallel state and the
        ranks share the writes of the one file (``fastckpt.sharedfile``): the parameters and optimizer state of
        the watched optimizers (kept identical by DDP) are split between the ranks by bytes; everything else
        (buffers such as BatchNorm's running statistics, plain values, the pickle) is rank 0's. The root must be a
        file system every rank sees (one node, or a shared POSIX file system)."""
        t0 = time.perf_counter()
        self._check_open()
        name = _check_file_name(name)
        if self._coord is not None and not can_share(self.storage):
            raise ConfigError(f"save_file() with distributed=True needs a file system every rank writes into; "
                              f"{self.storage.url} is not one (an object store takes one writer per file): save it "
                              "on rank 0, with a Checkpointer built without distributed=True")
        if self.config.staging.shm:
            raise ConfigError("staging.shm does not apply to single-file torch checkpoints (save_file); "
                              "set staging.shm: false, or use save() for the shared-memory tier")
        self._raise_pending()
        path = self.storage.join(self.storage.url, name)
        try:
            fmt, tensors, keys, sources = TorchFileFormat.plan(state, path)
        except (TypeError, AttributeError, RuntimeError, pickle.PicklingError) as e:
            raise StateMismatchError(f"cannot save this state as a torch file {path!r}: {e}") from e
        owners = [-1] * len(tensors)
        chunk = None
        if self._coord is not None:  # only what DDP keeps identical on every rank may come from another rank
            shared = self._optimizer_ptrs()
            owners = [-1 if t.data_ptr() in shared else self._coord.leader for t in tensors]
            chunk = _shared_chunk(self.config.persist.chunk_bytes, [r.nbytes for r in fmt.layout.records],
                                  self._coord.world)
        flat = FlatState(tree=None, tensors=tensors, keys=keys, numpy=[False] * len(tensors), objects=[],
                         owners=owners, lazy_src=list(tensors))
        limit = self.config.staging.max_host_bytes
        if limit is not None and fmt.layout.size > limit:
            raise ConfigError(f"staging.max_host_bytes ({limit}) is smaller than the torch file {path!r} "
                              f"({fmt.layout.size} bytes), which is written whole; raise the limit or unset it")
        # No root lock or garbage collection here: the folder is the framework's (Lightning lists it), and a
        # file appears by rename only once complete, so a killed save leaves no folder to collect.
        lazy_ptrs = self._lazy_ptrs(set(), set())
        return self._submit(flat, step, name, path, None, t0, lazy_ptrs, file_format=fmt, version_src=sources,
                            chunk_bytes=chunk)

    def save_files(self, files: dict[str, tuple[str, Any]], name: str, *, step: int = 0,
                   user: dict[str, Any] | None = None, made: bool = False) -> SaveHandle:
        """Snapshot a framework's checkpoint folder ``root/name`` as one save (``fastckpt.bundle``): ``files`` maps
        each file name to ``("safetensors", {key: tensor})`` or ``("torch", obj)`` (what ``torch.save(obj)``
        writes). Every file is written by the engine, then ``manifest.json`` (``"layout": "files"``, each file's
        size and CRC32C) last: the commit. Like ``save_file``: no root lock, no retention (the folder is the
        framework's), one process. ``made``: the caller created the folder, so a save whose folder vanished (the
        user removed it) fails instead of recreating it."""
        t0 = time.perf_counter()
        self._check_open()
        name = _check_file_name(name)
        if self._coord is not None or self.config.staging.shm:
            raise ConfigError("save_files() writes from one process and without staging.shm: build this "
                              "Checkpointer without distributed=True and with staging.shm: false")
        self._raise_pending()
        dirpath = self.storage.join(self.storage.url, name)
        try:
            fmt, tensors, keys, sources = FileBundle.plan(files, dirpath, name, step, self.storage, user, made)
        except (TypeError, ValueError, AttributeError, RuntimeError, pickle.PicklingError) as e:
            raise StateMismatchError(f"cannot save this state as the files of {dirpath!r}: {e}") from e
        limit = self.config.staging.max_host_bytes
        if limit is not None and fmt.size > limit:  # the buffers stay held until the commit: it would never fit
            raise ConfigError(f"staging.max_host_bytes ({limit}) is smaller than the files of {dirpath!r} "
                              f"({fmt.size} bytes), which are written whole; raise the limit or unset it")
        flat = FlatState(tree=None, tensors=tensors, keys=keys, numpy=[False] * len(tensors), objects=[],
                         owners=[-1] * len(tensors), lazy_src=list(tensors))
        return self._submit(flat, step, name, dirpath, None, t0, self._lazy_ptrs(set(), set()), file_format=fmt,
                            version_src=sources)

    def remove_file(self, name: str) -> Future:
        """Delete the file ``root/name`` after every save submitted before this call (a framework's retention:
        Lightning's ``remove_checkpoint``); missing is fine. The ``Future`` carries its error."""
        self._check_open()
        path = self.storage.join(self.storage.url, _check_file_name(name))
        return self._pipeline.run_in_order(lambda: self.storage.delete(path))  # type: ignore[union-attr]

    def _submit(self, flat: FlatState, step: int, name: str, dirpath: str, objects: bytes | None, t0: float,
                lazy_ptrs: set[int], *, dtensors: list[dict[str, Any]] | None = None,
                file_format: TorchFileFormat | FileBundle | None = None, version_src: list[Any] | None = None,
                chunk_bytes: int | None = None) -> SaveHandle:
        """Plan, take a staging slot, copy the eager shards now and queue the rest (both save paths)."""
        plan = self._planner.plan(flat, lambda t: t.data_ptr() in lazy_ptrs, chunk_bytes)
        writers = None
        if self._coord is not None and isinstance(file_format, TorchFileFormat):
            writers = self._coord.assign_file(plan)
        elif self._coord is not None:
            self._coord.assign(plan)
        devices = cuda_devices(flat.tensors)
        pin = bool(devices)
        stats = SaveStats(step=step, name=name)
        handle = SaveHandle(name=name, step=step, path=dirpath, stats=stats, _on_error_seen=self._mark_seen)
        cuda = self._prepare_cuda(name, devices) if pin else None  # before a slot is taken: a failure holds none
        # new pinned buffers are registered under the state's device: no stray context on GPU 0
        self._keep_pace(name)
        with torch.cuda.device(devices[0]) if pin else contextlib.nullcontext():
            slot = self._arena.acquire(plan, pin, block=self.config.staging.when_busy == "wait")
        if slot is None:
            return self._skipped(handle, t0)
        if self._errors:  # the slot freed because a save failed (a stalled write hit its deadline): say so now
            self._arena.release(slot)
            self._raise_pending()
        if self._uploader is not None and file_format is None:
            handle._upload = Future()
        job = Job(handle, plan, slot, flat.tensors, flat.keys, flat.numpy, flat.tree, objects, dirpath, t0,
                  dtensors=dtensors or [], file_format=file_format, version_src=version_src, file_writers=writers)
        if self._coord is not None:
            job.uid = self._coord.next_uid()
        if cuda is not None:
            job.cuda = cuda
            job.devices = [str(t.device) for t in flat.tensors]  # the saved locations map_location's dict keys name
        with self._lock:
            self._pending.append(handle)
        try:
            self._pipeline.stage_now(job, plan.mine([s for s in plan.shards if not s.lazy]))  # type: ignore[union-attr]
        except BaseException as e:
            job.error, job.reported = e, True  # the committer cleans up and frees the slot
            self._pipeline.submit(job, [])  # type: ignore[union-attr]
            raise FastCkptError(f"staging checkpoint {name!r} failed: {e}") from e
        events = [(d, ev) for (_, d), ev in job.shard_events.items()]
        if events:  # the next forward (BatchNorm stats) on each device must not overwrite what the copy reads
            gpu_wait(events)
        lazy = plan.mine([s for s in plan.shards if s.lazy])
        if not lazy:
            stats.staging_ms = (time.perf_counter() - t0) * 1e3  # CUDA: replaced when the copies are seen done
            handle._cuda_events = events
        self._pipeline.submit(job, lazy)  # type: ignore[union-attr]
        stats.blocking_ms = (time.perf_counter() - t0) * 1e3
        return handle

    def _keep_pace(self, name: str) -> None:
        """Raise the persistence threads when the previous checkpoint's persistence outlived the checkpoint
        interval (it is still pending now); lower them once nothing is. A busy slot always has a pending
        save (the committer frees the slot before it drops the save), so a save about to wait for a slot
        always raises them first."""
        with self._lock:
            late = self._pending[0].name if self._pending else None
        if late is None:
            self._priorities.settle()  # caught up: training comes first again
        else:
            self._priorities.raise_(f"checkpoint {late!r} was not durable yet when {name!r} was saved", behind=True)

    def _prepare_cuda(self, name: str, devices: list[int]) -> CudaCopy:
        """Streams and ready events of each device the state lives on (recorded now, on the caller's streams)."""
        try:
            return self._streams.prepare(devices)
        except Exception as e:
            raise FastCkptError(f"preparing the CUDA copies of checkpoint {name!r} on devices {devices} failed: "
                                f"{e}") from e

    def _skipped(self, handle: SaveHandle, t0: float) -> SaveHandle:
        log.warning("fastckpt: skipped checkpoint %r (step %d): all %d staging slots are busy (when_busy=skip)",
                    handle.name, handle.step, self.config.staging.slots)
        handle.skipped = True
        handle.stats.skipped = True
        handle.stats.blocking_ms = (time.perf_counter() - t0) * 1e3
        handle._staged.set()
        handle._durable.set_result(None)
        self.stats.append(handle.stats)
        return handle

    def _lazy_ptrs(self, also: set[int], never: set[int]) -> set[int]:
        if self.config.staging.mode != "lazy":
            return set()  # eager mode: save(lazy=...) is ignored too
        return (self._optimizer_ptrs() | also) - never

    def _optimizer_ptrs(self) -> set[int]:
        """Where the watched optimizers' parameters and state tensors start."""
        # Addresses, not tensor objects: state_dict() hands out detached aliases. A tensor is
        # lazy only if it starts exactly where a watched param/state tensor starts.
        ptrs: set[int] = set()
        for opt in list(self._watched):
            for group in opt.param_groups:
                ptrs.update(_address(p) for p in group["params"])
            for st in opt.state.values():
                ptrs.update(_address(v) for v in st.values() if isinstance(v, torch.Tensor))
        ptrs.discard(0)
        return ptrs

    def pending_names(self) -> list[str]:
        """Names of saves submitted but not yet committed or failed, oldest first."""
        with self._lock:
            return [h.name for h in self._pending]

    def wait_staged(self, *, host: bool = False) -> None:
        """Block until every pending snapshot's copies are queued; see ``SaveHandle.wait_staged``."""
        if not self._in_owner():
            return  # a fork()ed child: the parent's copies are not this process's to wait for
        with self._lock:
            pending = list(self._pending)
        for h in pending:
            h.wait_staged(host=host)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed (and uploaded, with a remote tier); raises a
        background error once, else ``CheckpointTimeoutError`` naming what is still pending after ``timeout``."""
        if not self._in_owner():
            return  # a fork()ed child: the parent's saves are not this process's to wait for
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = list(self._pending)
        if pending:  # the caller blocks on persistence: nothing to keep the CPU for
            self._priorities.raise_("wait() blocks on it", behind=False)
        wait_futures([h._durable for h in pending], timeout)
        uploader, pipeline = self._uploader, self._pipeline
        barrier: list[Future] = []
        if uploader is not None:
            wait_futures(uploader.pending_futures(), _remaining(deadline))
            if pipeline is not None and self.config.retention.keep_last is not None:
                # local retention that finished uploads queued on the committer has run once this returns
                barrier = [pipeline.run_in_order(lambda: None)]
                wait_futures(barrier, _remaining(deadline))
        self._raise_pending()
        left = self._unfinished(pending) + (["local retention"] if barrier and not barrier[0].done() else [])
        if left:
            raise CheckpointTimeoutError(
                f"Checkpointer.wait(timeout={timeout}) expired with {', '.join(left)} still pending; they go on in "
                "the background: call wait() again, or check the storage (a stalled write fails after "
                "network.timeout_s on an fsspec storage)")

    def _unfinished(self, saves: list[SaveHandle]) -> list[str]:
        """What ``wait``/``close`` still wait for: saves not committed, uploads not finished."""
        left = [f"save {h.name!r}" for h in saves if not h._durable.done()]
        uploader = self._uploader
        if uploader is not None and any(not f.done() for f in uploader.pending_futures()):
            left += [f"upload {n!r}" for n in sorted(uploader.pending_names())]
        return left

    # ---- background callbacks (committer thread) -----------------------------------

    def _on_commit(self, job: Job, info: CheckpointInfo) -> None:
        if isinstance(job.file_format, TorchFileFormat):  # a framework's file: not in the catalog, retention or remote
            # (a FileBundle folder is a checkpoint like save()'s: listed, retained and uploaded by its manifest)
            with self._lock:
                self._drop_pending(job.handle)
                self.stats.append(job.handle.stats)
            return
        self._catalog.committed(info)
        if self._uploader is not None:  # queued before leaving _pending: retention never sees it unprotected
            if job.handle._upload is None:
                job.handle._upload = Future()
            self._uploader.submit(info.name, info.path, job.handle._upload, job.handle)
        with self._lock:
            self._drop_pending(job.handle)
            self.stats.append(job.handle.stats)
        self._apply_retention()

    def _on_failure(self, job: Job, err: FastCkptError) -> None:
        log.error("fastckpt: checkpoint %r failed: %s", job.handle.name, err)
        with self._lock:
            if not job.reported:
                self._errors.append((job.handle, err))
            self._drop_pending(job.handle)
        if job.handle._upload is not None:
            settle(job.handle._upload, exc=err)  # never committed locally: nothing to upload

    # ---- remote tier callbacks (upload thread) ---------------------------------------

    def _on_uploaded(self, up: Upload, info: CheckpointInfo) -> None:
        pipeline = self._pipeline
        if pipeline is not None and self.config.retention.keep_last is not None:
            # local copies kept only because their upload was pending may go now (on the committer,
            # in order with saves and deletions)
            pipeline.run_in_order(self._apply_retention)

    def _on_upload_failed(self, up: Upload, err: FastCkptError) -> None:
        log.error("fastckpt: %s", err)
        if up.handle is not None:  # Checkpointer.upload(name) reports through its own future only
            with self._lock:
                self._errors.append((up.handle, err))

    def _drop_pending(self, handle: SaveHandle) -> None:
        if handle in self._pending:
            self._pending.remove(handle)

    def _mark_seen(self, handle: SaveHandle) -> None:
        with self._lock:
            self._errors = [(h, e) for h, e in self._errors if h is not handle]

    def _raise_pending(self) -> None:
        with self._lock:
            if not self._errors:
                return
            errors, self._errors = self._errors, []
        first = errors[0][1]
        for _, other in errors[1:]:
            log.error("fastckpt: another checkpoint also failed: %s", other)
        raise first

    # ---- committed checkpoints -----------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints under ``root`` and on the remote tier (by name, the local copy first),
        oldest step first."""
        self._check_open()
        return self._committed()[0]

    def _committed(self) -> tuple[list[CheckpointInfo], set[str]]:
        """The union of both tiers, and the names committed locally."""
        local = self._catalog.list()
        names = {i.name for i in local}
        if self._remote_catalog is None:
            return local, names
        try:
            remote = self._remote_catalog.list()
        except FastCkptError as e:
            url = self._remote_catalog.storage.url
            if not local:  # resuming from scratch because the remote is down would silently lose the run
                raise StorageError(f"cannot list the remote tier at {url} and {self.storage.url} holds no "
                                   f"checkpoint: {e}. Check remote.url, remote.storage_options and the network") from e
            log.warning("fastckpt: cannot list the remote tier at %s, using the local checkpoints only: %s", url, e)
            return local, names
        union = {i.name: i for i in remote}
        union.update((i.name, i) for i in local)
        return sorted(union.values(), key=lambda i: (i.step, i.name)), names

    def latest(self) -> int | None:
        """Newest committed step, or None."""
        infos = self.list()
        return infos[-1].step if infos else None

    def exists(self, name: str) -> bool:
        """Whether a checkpoint named ``name`` is committed (locally or on the remote tier)."""
        name = self._check_name(name)
        if self._catalog.info(name) is not None:
            return True
        return self._remote_catalog is not None and self._remote_catalog.info(name) is not None

    def reader(self, step: int | None = None, *, name: str | None = None) -> CheckpointReader:
        """A reader for one committed checkpoint (the latest by default); the local copy when there is
        one, else the remote tier's."""
        self._check_open()
        storage, target = self._locate(step, name)
        return self._open_reader(storage, storage.join(storage.url, target))

    def _open_reader(self, storage: Storage, dirpath: str) -> CheckpointReader:
        return CheckpointReader(storage, dirpath, verify=self.config.persist.verify_on_load,
                                workers=self.config.persist.workers, allowed_classes=self.config.allowed_classes,
                                coord=self._coord)

    def _read(self, step: int | None, name: str | None, use: Callable[[CheckpointReader], Any],
              shm: Callable[[CheckpointReader], Any] | None = None) -> Any:
        """``use`` a reader of the checkpoint; read again if a re-save of its name replaced it meanwhile.
        ``shm``: how to load it from the shared-memory tier instead, where it is still there (nearest first)."""
        self._check_open()
        storage, target = self._locate(step, name)
        dirpath = storage.join(storage.url, target)

        def run() -> Any:
            reader = self._open_reader(storage, dirpath)
            done = shm(reader) if shm is not None and self._shm is not None else None
            if done is not None:
                self.last_load_stats = done[1]
                return done[0]
            out = use(reader)
            self.last_load_stats = reader.stats
            return out

        if self._coord is not None:  # the ranks read together: one retrying alone would hang the others
            return run()
        return read_consistently(storage, dirpath, run)

    def _locate(self, step: int | None, name: str | None) -> tuple[Storage, str]:
        remote = self._remote_catalog
        if remote is None:
            return self.storage, self._check_name(name) if name is not None else self._catalog.resolve(step)
        if name is not None:
            name = self._check_name(name)
            if self._catalog.info(name) is not None:
                return self.storage, name
            if remote.info(name) is not None:
                return remote.storage, name
            raise CheckpointNotFoundError(f"no committed checkpoint {name!r} under {self.storage.url} or on the "
                                          f"remote tier at {remote.storage.url}; list them with Checkpointer.list()")
        infos, local = self._committed()
        if step is not None:
            infos = [i for i in infos if i.step == step]
        if not infos:
            what = f"at step {step}" if step is not None else "at all"
            raise CheckpointNotFoundError(f"no committed checkpoint {what} under {self.storage.url} or on the "
                                          f"remote tier at {remote.storage.url}")
        target = infos[-1].name
        return (self.storage if target in local else remote.storage), target

    def load(self, step: int | None = None, *, name: str | None = None, map_location: Any = None) -> Any:
        """Rebuild a saved state (the latest committed by default); tensors on CPU unless ``map_location``."""
        from_shm = None if map_location is not None else lambda reader: load_from_shm(self._shm, reader)
        return self._read(step, name, lambda reader: reader.load(map_location), from_shm)

    def load_into(self, target: Any, step: int | None = None, *, name: str | None = None) -> Any:
        """Copy a saved state into ``target``'s tensors in place (after pending lazy copies have read them)."""

        def into(reader: CheckpointReader) -> Any:
            self.wait_staged()
            return reader.load_into(target)

        def from_shm(reader: CheckpointReader) -> Any:
            self.wait_staged()
            return load_from_shm(self._shm, reader, target)

        return self._read(step, name, into, from_shm)

    def delete(self, name: str) -> Future:
        """Delete a committed checkpoint (both copies, with a remote tier) after every save (and upload)
        submitted before this call."""
        self._check_open()
        name = self._check_name(name)
        if not self._leader:
            done: Future = Future()
            done.set_result(None)  # rank 0 deletes for everyone
            return done
        self._claim_root()
        uploader = self._uploader
        if uploader is None:
            return self._pipeline.run_in_order(lambda: self._catalog.delete(name))  # type: ignore[union-attr]
        both: Future = Future()

        def local() -> None:  # on the committer, behind the saves; then on the upload thread, behind the uploads
            try:
                self._catalog.delete(name)
                failed = None
            except BaseException as e:  # noqa: BLE001 - the remote copy is still deleted, then this is raised
                failed = e

            def remote() -> None:
                uploader.catalog.delete(name)
                if failed is not None:
                    raise failed

            uploader.run_in_order(remote, both)

        self._pipeline.run_in_order(local)  # type: ignore[union-attr]
        return both

    def upload(self, name: str) -> Future:
        """Upload the locally committed checkpoint ``name`` to the remote tier (again), after every save
        submitted before this call: the retry after an upload failure, or for a checkpoint committed by a
        process that died before uploading it. The ``Future`` resolves to the remote ``CheckpointInfo``;
        its error is raised only through it."""
        self._check_open()
        name = self._check_name(name)
        done: Future = Future()
        if self._remote_catalog is None:
            raise ConfigError("Checkpointer.upload() needs a remote tier: set remote.url in the config")
        uploader = self._uploader
        if uploader is None:
            done.set_result(None)  # rank 0 uploads for everyone
            return done

        def submit() -> None:
            info = self._catalog.info(name)
            if info is None:
                raise CheckpointNotFoundError(f"no committed checkpoint {name!r} under {self.storage.url} to upload")
            uploader.submit(name, info.path, done)

        queued = self._pipeline.run_in_order(submit)  # type: ignore[union-attr]
        queued.add_done_callback(lambda f: f.exception() is not None and settle(done, exc=f.exception()))
        return done

    def _apply_retention(self) -> None:
        if self._leader:
            with self._lock:
                pending = {h.name for h in self._pending}
            if self._uploader is not None:
                pending |= self._uploader.pending_names()  # never delete what is still being uploaded
            self._catalog.retain(self.config.retention, pending)

    # ---- lifecycle -----------------------------------------------------------------

    @property
    def distributed(self) -> bool:
        """Whether the ranks of a process group share this Checkpointer's saves (``distributed=True``)."""
        return self._coord is not None

    @property
    def _leader(self) -> bool:
        return self._coord is None or self._coord.rank == 0

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

    @staticmethod
    def _check_name(name: str) -> str:
        if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", "..") or name.startswith("."):
            raise ConfigError(f"checkpoint name {name!r} must be a non-empty file name without '/' or a leading '.'")
        return name

    def close(self, timeout: float | None = None) -> None:
        """Flush pending saves, stop the threads, free staging memory; raise a background error once."""
        pipeline, self._pipeline = getattr(self, "_pipeline", None), None
        if pipeline is None:
            return
        if not self._in_owner():
            return  # a fork()ed child only forgets the parent's saves: flushing them would wait forever
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = list(self._pending)
        if pending:
            self._priorities.raise_("close() flushes it", behind=False)
        wait_futures([h._durable for h in pending], timeout)
        for wh in self._hooks:
            wh.remove()
        drained = pipeline.close(_remaining(deadline))
        stuck = self._unfinished(pending)
        uploader = self._uploader
        if uploader is not None:
            uploader.close(_remaining(deadline))  # flush the uploads (bounded), then stop its threads
            if self.config.retention.keep_last is not None and drained:
                self._apply_retention()  # what was kept only for a pending upload
            self._uploader = None
        self._priorities.close()
        if drained:
            if self._coord is not None:
                self._coord.close()  # every commit is done: its private group's threads can be joined
            self._arena.close()  # else a stalled writer still reads its slot: the buffers go with the process
            if self._root_lock is not None:
                self._root_lock.release()  # after the last commit and retention: the next writer may start
            self._raise_pending()
            return
        # Timed out: the lock stays held (a stalled save may still commit into the root until this process exits).
        err = CheckpointTimeoutError(
            f"Checkpointer.close(timeout={timeout}) expired with {', '.join(stuck) or 'queued deletions'} still "
            "pending: the storage stalled. The previous committed checkpoint is intact; this one may still commit "
            "or fail in the background (an fsspec storage gives up after network.timeout_s)")
        log.warning("fastckpt: %s", err)  # a background error, if any, is raised first
        self._raise_pending()
        raise err

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except FastCkptError as e:  # don't mask the exception already in flight
            log.error("fastckpt: while closing after an error: %s", e)

    def __del__(self) -> None:
        if getattr(self, "_pipeline", None) is not None:
            try:
                self.close()
            except Exception:  # noqa: BLE001 - nothing can be raised from __del__
                pass


def _address(t: torch.Tensor) -> int:
    """Where ``t``'s data starts; a DTensor's (FSDP2 parameter, its optimizer state) is its local block's."""
    local = getattr(t, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else t).data_ptr()


def _check_file_name(name: str) -> str:
    """A framework's file name (``save_file``): any plain name (Lightning's ddp_spawn saves ``.temp.ckpt``), but not
    one of the temporary names ``write_file_atomic`` uses."""
    if not is_plain_name(name) or ".fastckpt-tmp-" in name:
        raise ConfigError(f"file name {name!r} must be one plain file name (no '/', not '.' or '..')")
    return name


def _named_ptrs(flat: Any, names: Any, what: str) -> set[int]:
    """Addresses of the tensors ``save(eager=/lazy=...)`` names: tensors, or fnmatch patterns of flattened keys."""
    if isinstance(names, (str, torch.Tensor)):
        names = [names]
    names = list(names)
    patterns = [e for e in names if isinstance(e, str)]
    ptrs = {_address(t) for t in names if isinstance(t, torch.Tensor)}
    bad = [e for e in names if not isinstance(e, (str, torch.Tensor))]
    if bad:
        raise ConfigError(f"save({what}=...) takes tensors or key patterns (str), got {type(bad[0]).__name__}")
    if patterns:
        ptrs.update(_address(src) for key, src in zip(flat.keys, flat.lazy_src)
                    if any(fnmatch.fnmatchcase(key, p) for p in patterns))
    return ptrs


def _shared_chunk(chunk_bytes: int, sizes: list[int], world: int) -> int:
    """The shard size of a torch file shared by ``world`` ranks: about four shards per rank, so that the balance by
    bytes (in whole shards) evens out, and never above ``persist.chunk_bytes``. A function of the structure only, so
    every rank plans alike and the plan stays cached."""
    return max(4096, min(chunk_bytes, sum(sizes) // (4 * world)))


def _check_storage(storage: Storage, what: str) -> None:
    """The one cheap probe at construction: a typo'd bucket or an unwritable root fails now, not at resume."""
    check = getattr(storage, "check", None)
    if check is not None:
        check(what)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _exit_flusher(ckpt: Checkpointer) -> Any:
    ref = weakref.ref(ckpt)

    def flush() -> None:
        obj = ref()
        if obj is None or obj._pipeline is None:
            return
        n = len(obj._pending) + (len(obj._uploader.pending_futures()) if obj._uploader is not None else 0)
        if n:
            log.warning("fastckpt: interpreter exiting, flushing %d pending checkpoint(s) (up to %.0fs)", n, _EXIT_FLUSH_S)
        try:
            obj.close(timeout=_EXIT_FLUSH_S)
        except Exception as e:  # noqa: BLE001 - report, never raise at exit
            log.error("fastckpt: pending checkpoint failed at exit: %s", e)

    return flush
