"""``Saver``: turns a state into a save job (plan, slot, eager copies) and keeps the ledger of saves in flight.

``Checkpointer`` wires one ``Saver`` and delegates ``save``, ``save_file`` and ``save_files`` to it. The saver owns
what every save path shares: the watched optimizers (whose tensors are copied lazily), the pending saves, the
background errors not yet raised (each raised once, at the next ``save``/``wait``/``close``) and the figures of
finished saves. The pipeline it owns stages, writes and commits; committing is reported to ``on_commit``.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import threading
import time
import weakref
from typing import AbstractSet, Any, Callable, Hashable

import torch

from ..config import CheckpointConfig
from ..errors import ConfigError, FastCkptError, FolderRemovedError, StateMismatchError, StorageError
from ..format.bundle import FileBundle
from ..format.codec import dumps_objects
from ..format.flatcache import FlatCache
from ..format.identity import address, named_addresses
from ..format.layout import CheckpointInfo
from ..format.openlayout import OPEN_LAYOUT
from ..format.paths import checkpoint_name, file_name, file_path
from ..format.plan import FlatState, Planner, flatten
from ..format.protocol import FileFormat
from ..format.shm_record import StagedRecord
from ..format.safetensorsobject import plan_file
from ..format.torchfile import TorchFileFormat
from ..storage.protocol import Storage
from .affinity import resolve
from .dedupwrite import DirectDedup
from .distributed import Coordinator
from .futures import settle
from .handle import SaveHandle, SaveStats
from .pipeline import Job, Pipeline
from .pace import keep_pace, slot_wait_reason, warn_all_eager, warn_retake
from .priority import ThreadPriorities
from .sharedfile import can_share, shared_chunk
from .sharedobject import can_share_object, shared_write, sweep_once
from .stale import Hooks, StaleWatch
from .staging import HostArena, Slot
from .streams import CopyStreams, CudaCopy, cuda_devices, gpu_wait, snapshotted
from .watch import WatchHandle, Watched, WatchedCache
from .writepace import WritePacer

__all__ = ["Saver", "WatchHandle"]

log = logging.getLogger("fastckpt")


class Saver:
    """Owns the pipeline and the ledger of one ``Checkpointer``'s saves."""

    def __init__(self, config: CheckpointConfig, storage: Storage, *, planner: Planner, arena: HostArena,
                 streams: CopyStreams, priorities: ThreadPriorities, coord: Coordinator | None, uploads: bool,
                 claim_root: Callable[[], None], on_commit: Callable[[Job, CheckpointInfo], None],
                 pipeline: Callable[..., Pipeline] = Pipeline) -> None:
        """``uploads``: committed saves go to the remote tier (their handles get an upload future); ``pipeline``:
        the class that runs the saves (``Pipeline``, or ``tiers/persister.py``'s with ``persist.process``).
        ``claim_root``: called by ``save()`` after its checks, before anything is written into the root.
        ``on_commit``: called on the committer once a save is committed, before its handle resolves; it must
        call ``settle(handle)``."""
        self.config, self.storage = config, storage
        self._planner, self._arena, self._streams, self._priorities = planner, arena, streams, priorities
        self._coord, self._uploads, self._claim_root = coord, uploads, claim_root
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._watched_ids = WatchedCache()  # the watched optimizers' identities, walked again only when they change
        self._flats = FlatCache()  # save()'s flattening: the last state's skeleton, reused (format/flatcache.py)
        self._hooks: list[WatchHandle] = []
        self._lock = threading.Lock()
        self._pending: list[SaveHandle] = []
        self._errors: list[tuple[SaveHandle, FastCkptError]] = []
        self.stats: list[SaveStats] = []
        self.stale = StaleWatch(config.health.enabled, config.health.stale_warning)  # also asks for health
        self.dedup = DirectDedup.of(config, storage, coord is None, uploads)  # an s3:// root's source, clones, records
        resolve(config.persist.background_cpus, 1)  # a CPU this process may not use: ConfigError, no thread started
        self.pipeline = pipeline(storage, arena, config.persist.workers, self.dedup.watching(on_commit),
                                 self._on_failure, coord, priorities=priorities)
        self._moved: set[str] = set()  # keys a seal found moved (on_mutation retake): staged eagerly from then on
        self._retaking: SaveHandle | None = None  # set while a refused snapshot is taken again under its handle
        try:  # the pipeline's threads run now: a failure below stops them, so a refused constructor leaves none
            self.pipeline.on_refused, self.pipeline.staging = self._on_refused, config.staging
            self.pipeline.pacer = WritePacer(config.persist.chunk_bytes) if config.persist.pace_writes else None
            self.pipeline.cpu_threads(config.persist.cpu_threads)
            gate = self.pipeline.gate
            self.pipeline.placement.follow(config.persist.background_cpus, lambda: gate.limit() if gate.limit else 1)
        except BaseException:
            self.pipeline.close()  # idle threads: they stop at once on their sentinels
            raise

    # ---- watched optimizers --------------------------------------------------------

    def watch(self, optimizer: torch.optim.Optimizer, wait: Callable[[], None] | None) -> WatchHandle:
        """Mark ``optimizer``'s params and state as lazily copyable; with ``wait``, its step() first calls it (the
        owner's ``wait_staged``, which a subclass or a fork()ed child may change)."""
        handle = Hooks(optimizer.register_step_pre_hook(lambda *_: wait()) if wait is not None else None,
                       optimizer.register_step_post_hook(self.stale.count))  # steps between checkpoints
        self._watched.add(optimizer)
        wh = WatchHandle(self, optimizer, handle)
        self._hooks.append(wh)
        return wh

    def unwatch(self, optimizer: Any) -> None:
        """Called by ``WatchHandle.remove``: ``optimizer``'s tensors are copied eagerly again."""
        self._watched.discard(optimizer)

    def unwatch_all(self) -> None:
        """Called by ``Checkpointer.close``: remove every step hook this saver registered."""
        for wh in self._hooks:
            wh.remove()

    # ---- the three save paths ------------------------------------------------------

    def save(self, state: Any, step: int, *, name: str | None = None, eager: Any = (), lazy: Any = ()) -> SaveHandle:
        """``Checkpointer.save``: the open layout (safetensors shards + meta + manifest) under ``root/name``."""
        t0 = time.perf_counter()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"save(step=...) must be a non-negative int, got {step!r}")
        name = checkpoint_name(name if name is not None else f"step-{step:09d}")
        if self._retaking is None:  # a retake runs inside a seal: the other errors wait for the caller
            self.seal_all(block=False)  # the staged ones: waiting here for a copy would cost the overlap
            self.raise_pending()
        flat = self._flats.flatten(state)  # StateMismatchError names what it cannot walk
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
        eager_ptrs = named_addresses(flat, eager, "eager")
        lazy_ptrs, watched = self._lazy_ptrs(named_addresses(flat, lazy, "lazy"), eager_ptrs, certified=flat.token)
        dirpath = self.storage.join(self.storage.url, name)
        if self.config.staging.mode == "lazy" and flat.tensors and self._retaking is None and not any(
                i in lazy_ptrs for i in flat.identities()) and not all(i in eager_ptrs for i in flat.identities()):
            # the whole copy happens inside this call: say so, with the fix; not when save(eager=...) chose it (the
            # preemption's final save, eager="*")
            warn_all_eager(name, flat.tensors)
        return self._submit(flat, step, name, dirpath, t0, lazy_ptrs, watched, objects=objects,
                            dtensors=[rec.as_json() for rec in flat.dtensors],
                            retake=lambda: self.save(state, step, name=name, eager=eager, lazy=lazy))

    def plan_of(self, state: Any, *, eager: Any = (), lazy: Any = ()) -> tuple[Any, list[int]]:
        """``Checkpointer.prewarm``: the plan ``save(state, eager=, lazy=)`` would use and the CUDA devices."""
        flat = flatten(state)  # StateMismatchError names what it cannot walk
        lazy_ptrs, _ = self._lazy_ptrs(named_addresses(flat, lazy, "lazy"), named_addresses(flat, eager, "eager"))
        return self._planner.plan(flat, lazy_ptrs, None), cuda_devices(flat.tensors)

    def save_file(self, state: Any, name: str, *, step: int = 0, kind: str = "torch") -> SaveHandle:
        """``Checkpointer.save_file``: one torch file ``root/name`` (``kind="safetensors"``: a safetensors file).

        With ``distributed=True``, every rank calls this with its own copy of the same data-parallel state and the
        ranks share the writes of the one file (``fastckpt.engine.sharedfile``): the parameters and optimizer state
        of the watched optimizers (kept identical by DDP) are split between the ranks by bytes; everything else
        (buffers such as BatchNorm's running statistics, plain values, the pickle) is rank 0's. The root must be a
        file system every rank sees (one node, or a shared POSIX file system), or S3: then every rank uploads its
        parts of one multipart upload, which rank 0 completes (``fastckpt.engine.sharedobject``)."""
        t0 = time.perf_counter()
        name = file_path(name)
        if self._coord is not None and not (can_share(self.storage) or can_share_object(self.storage)):
            raise ConfigError(f"save_file() with distributed=True needs a file system every rank writes into, or S3 "
                              f"(each rank uploads parts of one object); {self.storage.url} is neither (this object store "
                              "takes one writer per file): save it on rank 0, with a Checkpointer without distributed=True")
        if self.config.staging.shm:
            raise ConfigError("staging.shm does not apply to save_file; set staging.shm: false, or use save()")
        if self._retaking is None:  # a retake runs inside a seal: the other errors wait for the caller
            self.seal_all(block=False)  # the staged ones: waiting here for a copy would cost the overlap
            self.raise_pending()
        path = self.storage.join(self.storage.url, name)
        try:
            fmt, tensors, keys, sources = plan_file(kind, state, path)
        except ConfigError:  # an unknown kind: the call is wrong, not the state
            raise
        except (TypeError, ValueError, AttributeError, RuntimeError, pickle.PicklingError) as e:
            raise StateMismatchError(f"cannot save this state as a torch file {path!r}: {e}") from e
        owners = [-1] * len(tensors)
        chunk = None
        lazy_ptrs, watched = self._lazy_ptrs()
        if self._coord is not None:  # only what DDP keeps identical on every rank may come from another rank
            shared = watched[0] | watched[1]
            owners = [-1 if address(t) in shared else self._coord.leader for t in tensors]
            chunk = shared_chunk(self.config.persist.chunk_bytes, [r.nbytes for r in fmt.layout.records],
                                  self._coord.world)
        flat = FlatState(tree=None, tensors=tensors, keys=keys, numpy=[False] * len(tensors), objects=[],
                         owners=owners, lazy_src=list(tensors))
        self._check_fits(fmt.layout.size, f"the torch file {path!r}", "is")
        # No root lock or garbage collection here: the folder is the framework's (Lightning lists it), and a
        # file appears by rename only once complete, so a killed save leaves no folder to collect.
        return self._submit(flat, step, name, path, t0, lazy_ptrs, watched, file_format=fmt,
                            version_src=sources, chunk_bytes=chunk, shared_file=fmt if self._coord is not None else None,
                            retake=lambda: self.save_file(state, name, step=step, kind=kind))

    def save_files(self, files: dict[str, tuple[str, Any]], name: str, *, step: int = 0,
                   user: dict[str, Any] | None = None, made: bool = False,
                   loaders: dict[str, Any] | None = None, staged: bool = False) -> SaveHandle:
        """``Checkpointer.save_files``: a framework's checkpoint folder ``root/name`` as one save
        (``fastckpt.format.bundle``): every file is written by the engine, then ``manifest.json`` (``"layout":
        "files"``, each file's size and CRC32C) last: the commit. No root lock, no retention (the folder is the
        framework's), one process. ``user``: extra fields of the manifest. ``made``: the caller created the folder,
        so a save whose folder vanished (the user removed it) fails instead of recreating it. ``loaders``: torch file
        name -> the ``PickleLoader`` that will read it; the committer unpickles each file's pickle as it will before
        the commit (``FileBundle.check_pickles``), so a file that would not load fails the save, not the resume."""
        t0 = time.perf_counter()
        name = file_name(name)
        if self._coord is not None or self.config.staging.shm:
            raise ConfigError("save_files() writes from one process and without staging.shm: build this "
                              "Checkpointer without distributed=True and with staging.shm: false")
        if self._retaking is None:  # a retake runs inside a seal: the other errors wait for the caller
            self.seal_all(block=False)  # the staged ones: waiting here for a copy would cost the overlap
            self.raise_pending()
        dirpath = self.storage.join(self.storage.url, name)
        if can_share_object(self.storage):  # no root claim here: only the uploads a killed save left are aborted
            sweep_once(self.storage, self.config.orphan_grace_s)
        try:
            fmt, tensors, keys, sources = FileBundle.plan(files, dirpath, name, step, self.storage, user, made,
                                                         loaders, staged)
        except (TypeError, ValueError, AttributeError, RuntimeError, pickle.PicklingError) as e:
            raise StateMismatchError(f"cannot save this state as the files of {dirpath!r}: {e}") from e
        # the buffers stay held until the commit: a state larger than the limit would never fit
        self._check_fits(fmt.size, f"the files of {dirpath!r}", "are")
        # Visibly incomplete from now on: a copy made before the commit is refused, never taken as whole. Not while
        # an earlier save of the same folder is pending: its commit removes the marker (this save marks at its own).
        if made and not any(h.path == dirpath for h in self.pending()):
            fmt.mark(self.storage)
        flat = FlatState(tree=None, tensors=tensors, keys=keys, numpy=[False] * len(tensors), objects=[],
                         owners=[-1] * len(tensors), lazy_src=list(tensors))
        lazy_ptrs, watched = self._lazy_ptrs()
        return self._submit(flat, step, name, dirpath, t0, lazy_ptrs, watched, file_format=fmt, version_src=sources,
                            retake=lambda: self.save_files(files, name, step=step, user=user, made=made,
                                                           loaders=loaders, staged=staged))

    def submit_recovered(self, rec: StagedRecord, slot: Slot) -> SaveHandle:
        """Persist a snapshot a crashed process staged in shared memory (its bytes are in ``slot`` already)."""
        log.warning("fastckpt: recovering %s, staged in shared memory by a crashed process", rec.label)
        handle = self.new_handle(rec.name, rec.step, rec.dirpath)
        if self._uploads:
            handle.expect_upload()
        job = Job(handle=handle, plan=rec.plan, slot=slot, tensors=[], keys=rec.keys, numpy=rec.numpy, tree=rec.tree,
                  objects=rec.objects, dirpath=rec.dirpath, t0=time.perf_counter(), uid=rec.uid, dtensors=rec.dtensors,
                  staged_crcs=rec.crcs)
        job.health = {} if self.stale.measure else None
        with self._lock:
            self._pending.append(handle)
        self.pipeline.submit_recovered(job)
        return handle

    def new_handle(self, name: str, step: int, path: str, nbytes: int = 0) -> SaveHandle:
        """A handle whose error, once seen through ``wait()``, is no longer raised by this saver."""
        return SaveHandle(name=name, step=step, path=path, stats=SaveStats(step=step, name=name, nbytes=nbytes),
                          _on_error_seen=self._mark_seen, _on_block=self._on_block)

    def _on_block(self) -> None:
        self._priorities.waiting("wait() blocks on a save")

    def _check_fits(self, size: int, what: str, verb: str) -> None:
        limit = self.config.staging.max_host_bytes
        if limit is not None and size > limit:
            raise ConfigError(f"staging.max_host_bytes ({limit}) is smaller than {what} ({size} bytes), which "
                              f"{verb} written whole; raise the limit or unset it")

    def _submit(self, flat: FlatState, step: int, name: str, dirpath: str, t0: float,
                lazy_ptrs: AbstractSet[Hashable], watched: Watched, *,
                objects: bytes | None = None, dtensors: list[dict[str, Any]] | None = None,
                file_format: FileFormat = OPEN_LAYOUT, version_src: list[Any] | None = None,
                chunk_bytes: int | None = None, shared_file: TorchFileFormat | None = None,
                retake: Callable[[], SaveHandle] | None = None) -> SaveHandle:
        """Plan, take a staging slot, copy the eager shards now and queue the rest (every save path). ``retake``:
        the same save again (staging.on_mutation retake), run all eager under this save's handle if refused."""
        if self._moved and lazy_ptrs:  # a seal found these moved outside step(): copied inside save() from now on
            lazy_ptrs = lazy_ptrs - {i for i, key in zip(flat.identities(), flat.keys) if key in self._moved}
        plan = self._planner.plan(flat, lazy_ptrs, chunk_bytes)
        writers = None
        if self._coord is not None and shared_file is not None:
            writers = self._coord.assign_file(plan, contiguous=can_share_object(self.storage))
        elif self._coord is not None and self._coord.agreed(plan):
            self._coord.assign(plan, flat.keys)
        elif self._coord is not None:
            # The agreement on a new plan is a collective on the private group, which the committers also use for
            # earlier saves' commits. Every rank queues it behind the same saves, so the ranks issue the group's
            # collectives in one order; on the training thread it could pair with another rank's commit. It waits
            # for the pending commits only when a new plan appears (the first save, a changed structure).
            coord, keys = self._coord, flat.keys
            self.seal_all()  # the committer reaches this only past the pending commits, which wait for their seals
            self._priorities.waiting("save() agrees a new plan with the other ranks")
            self.pipeline.run_in_order(lambda: coord.assign(plan, keys)).result()
        memo = flat.token.memo if flat.token is not None else {}  # once per structure (format/flatcache.py)
        devices = memo["devices"] if "devices" in memo else memo.setdefault("devices", cuda_devices(flat.tensors))
        pin = bool(devices)
        retaking, self._retaking = self._retaking, None
        handle = retaking if retaking is not None else self.new_handle(name, step, dirpath)
        stats = handle.stats
        cuda = self._prepare_cuda(name, devices, flat.tensors) if pin else None  # before a slot: a failure holds none
        keep_pace(self.pending(), self._priorities, self.config.persist.max_lag_s, name)
        # new pinned buffers are registered under the state's device: no stray context on GPU 0
        with torch.cuda.device(devices[0]) if pin else contextlib.nullcontext():
            slot = self._arena.acquire(plan, pin, block=False)
            if slot is None and self.config.staging.when_busy == "wait":
                self.seal_all()  # a slot frees at a commit, which waits for its seal: seal before blocking
                # training stalls until a slot frees: persistence really is behind
                why = slot_wait_reason(self.pending(), self.config.staging.slots, name)
                self._priorities.raise_(why, behind=True)
                slot = self._arena.acquire(plan, pin, block=True)
        if slot is None:
            return self._skipped(handle, t0)
        if self._errors:  # the slot freed because a save failed (a stalled write hit its deadline): say so now
            self._arena.release(slot)
            self.raise_pending()
        if self._uploads and file_format.catalogued:
            handle.expect_upload()
        job = Job(handle=handle, plan=plan, slot=slot, tensors=flat.tensors, keys=flat.keys, numpy=flat.numpy,
                  tree=flat.tree, objects=objects, dirpath=dirpath, t0=t0, dtensors=dtensors or [],
                  file_format=file_format, version_src=version_src, dedup=self.dedup.source(file_format.catalogued),
                  token=flat.token if version_src is None else None)
        job.records = job.dedup is not None
        self.stale.prepare(job, watched[1], lambda: flat.identities() if version_src is None else
                           [address(src) for src in version_src])
        if self._coord is not None:
            job.uid = self._coord.next_uid()
        elif retake is not None and self.config.staging.on_mutation == "retake":
            job.retake = lambda keys: self._retake(handle, keys, retake)
        if writers is not None and shared_file is not None and self._coord is not None:
            job.shared = shared_write(self._coord, self.storage, shared_file, job.uid, writers, name, step, flat.keys,
                                      self.config.orphan_grace_s, self.config.remote.dedup)
        if cuda is not None:
            job.cuda = cuda
            job.devices = [str(t.device) for t in flat.tensors]  # the saved locations map_location's dict keys name
        with self._lock:
            if handle not in self._pending:  # a retake keeps its place
                self._pending.append(handle)
        try:
            self.pipeline.stage_now(job, plan.mine([s for s in plan.shards if not s.lazy]))
            events = [(d, ev) for (_, d), ev in job.shard_events.items()] if not snapshotted(job) else []
            if events:  # the next forward (BatchNorm stats) on each device must not overwrite what the copy reads
                # Inside the try: a CUDA error here must still hand the job to the committer, which fails the
                # handle and frees the slot (outside, the handle stayed pending and close() hung).
                gpu_wait(events)
        except BaseException as e:
            job.error, job.reported = e, True  # the committer cleans up and frees the slot
            self.pipeline.submit(job, [])
            if isinstance(e, StorageError):  # ring mode: a write failed while save() still staged; raised here, once
                raise
            raise FastCkptError(f"staging checkpoint {name!r} failed: {e}") from e
        lazy = plan.mine([s for s in plan.shards if s.lazy])
        if not lazy:
            stats.staging_ms = (time.perf_counter() - t0) * 1e3  # CUDA: replaced when the copies are seen done
            handle.track_copies(events)
        self.pipeline.submit(job, lazy)
        stats.blocking_ms = (time.perf_counter() - t0) * 1e3
        return handle

    def _prepare_cuda(self, name: str, devices: list[int], tensors: list[Any]) -> CudaCopy:
        """Streams and ready events of each device the state lives on (recorded now, on the caller's streams)."""
        try:
            return self._streams.prepare(devices, tensors)  # staging.device_snapshot: the device copy first
        except Exception as e:
            raise FastCkptError(f"preparing the CUDA copies of checkpoint {name!r} on devices {devices} failed: "
                                f"{e}") from e

    def _skipped(self, handle: SaveHandle, t0: float) -> SaveHandle:
        log.warning("fastckpt: skipped checkpoint %r (step %d): all %d staging slots are busy (when_busy=skip)",
                    handle.name, handle.step, self.config.staging.slots)
        handle.skipped = True
        handle.stats.skipped = True
        handle.stats.blocking_ms = (time.perf_counter() - t0) * 1e3
        handle.mark_staged()
        handle.set_committed(None)
        self.stats.append(handle.stats)
        return handle

    def _lazy_ptrs(self, also: AbstractSet[Hashable] = frozenset(), never: AbstractSet[Hashable] = frozenset(),
                   certified: Any = None) -> tuple[AbstractSet[Hashable], Watched]:
        """The identities to copy lazily, and the watched optimizers' own (``watched_identities``; ``certified``: see
        ``WatchedCache.get``); without ``also`` and ``never``, one frozenset while the optimizers are unchanged."""
        watched = self._watched_ids.get(list(self._watched), certified)
        if self.config.staging.mode != "lazy" or self._retaking is not None:
            return set(), watched  # eager mode: save(lazy=...) is ignored too; a retake is taken whole, at the seal
        return ((watched[0] | watched[1] | also) - never if also or never else self._watched_ids.union), watched

    # ---- the ledger: saves in flight, errors not yet raised --------------------------

    def pending(self) -> list[SaveHandle]:
        """The saves submitted but not yet committed or failed, oldest first (a copy)."""
        with self._lock:
            return list(self._pending)

    def pending_names(self) -> list[str]:
        """Names of saves submitted but not yet committed or failed, oldest first."""
        return [h.name for h in self.pending()]

    def drain(self) -> None:
        """Block until the committer has run everything submitted so far (the commits of every pending save), and
        raise nothing: a distributed load's collectives then never pair with a commit's on another rank."""
        self.seal_all()  # a lazy save commits only once sealed
        self._priorities.waiting("a load waits for the pending commits")
        self.pipeline.run_in_order(lambda: None).result()

    def seal_all(self, *, block: bool = True) -> None:
        """Seal every pending save, oldest first, on the calling (training) thread (fastckpt/engine/seal.py).
        ``block=False``: stop at the first one still staging (sealed later; in order, since a retake waits for the
        commits before it)."""
        for h in self.pending():
            if not block and not h.staged():
                return
            h.seal()

    def _on_refused(self, job: Job, err: BaseException) -> None:
        """Called at a seal that refused ``job`` (on_mutation raise): raised by the save() sealing it, else at the
        next save/wait/close, once."""
        with self._lock:
            if not job.reported and isinstance(err, FastCkptError):
                self._errors.append((job.handle, err))
                job.reported = True

    def _retake(self, handle: SaveHandle, keys: list[str], again: Callable[[], SaveHandle]) -> None:
        """At the seal of a refused snapshot (staging.on_mutation retake), once the committer has cleared it: take
        the same save again, all eager, under ``handle``; ``keys`` are copied eagerly in every later save."""
        new = [k for k in keys if k not in self._moved]
        self._moved.update(keys)
        self._retaking = handle
        try:
            again()
        except FastCkptError as e:
            self._fail_retake(handle, e)
        except Exception as e:  # noqa: BLE001 - reported through the handle, like a background failure
            err = StorageError(f"taking checkpoint {handle.name!r} again after a refused lazy snapshot failed: {e}")
            err.__cause__ = e
            self._fail_retake(handle, err)
        finally:
            self._retaking = None
        if new:  # after the retake: a warnings filter set to "error" raises here, the checkpoint already retaken
            warn_retake(handle.name, new)

    def _fail_retake(self, handle: SaveHandle, err: FastCkptError) -> None:
        log.error("fastckpt: checkpoint %r failed: %s", handle.name, err)
        with self._lock:
            self._errors.append((handle, err))
            self._drop_pending(handle)
        if not handle.done():
            handle.set_failed(err)

    def wait_staged(self, *, host: bool = False) -> None:
        """Block until every pending snapshot's copies are queued; see ``SaveHandle.wait_staged``."""
        for h in self.pending():
            h.wait_staged(host=host)

    def settle(self, handle: SaveHandle) -> None:
        """Called by ``on_commit`` on the committer: ``handle`` leaves the pending saves, its figures are kept."""
        with self._lock:
            self._drop_pending(handle)
            self.stats.append(handle.stats)

    def record_error(self, handle: SaveHandle | None, err: FastCkptError) -> None:
        """A background error (a failed upload) to raise once, at the next ``save``/``wait``/``close``."""
        if handle is not None:  # Checkpointer.upload(name) reports through its own future only
            with self._lock:
                self._errors.append((handle, err))

    def raise_pending(self) -> None:
        """Raise the oldest background error not yet raised (logging the others), once."""
        with self._lock:
            if not self._errors:
                return
            errors, self._errors = self._errors, []
        first = errors[0][1]
        for _, other in errors[1:]:
            log.error("fastckpt: another checkpoint also failed: %s", other)
        raise first

    def _on_failure(self, job: Job, err: FastCkptError) -> None:
        # The user removed the folder (a TemporaryDirectory's cleanup right after the save): their removal wins,
        # as it would after a stock synchronous save. Said once; not raised at the next save/wait/close.
        quiet = isinstance(err, FolderRemovedError)
        if quiet:
            log.warning("fastckpt: %s", err)
        else:
            log.error("fastckpt: checkpoint %r failed: %s", job.handle.name, err)
        with self._lock:
            if not job.reported and not quiet:
                self._errors.append((job.handle, err))
            self._drop_pending(job.handle)
        if job.handle.upload is not None:
            settle(job.handle.upload, exc=err)  # never committed locally: nothing to upload

    def _drop_pending(self, handle: SaveHandle) -> None:
        if handle in self._pending:
            self._pending.remove(handle)

    def _mark_seen(self, handle: SaveHandle) -> None:
        with self._lock:
            self._errors = [(h, e) for h, e in self._errors if h is not handle]

