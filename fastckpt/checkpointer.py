"""``Checkpointer``: save() -> SaveHandle, load(), latest(), retention, close()."""
from __future__ import annotations

import atexit
import logging
import re
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch

from .catalog import Catalog
from .codec import dumps_objects
from .distributed import Coordinator
from .config import CheckpointConfig
from .errors import ConfigError, FastCkptError, StateMismatchError
from .handle import CheckpointInfo, SaveHandle, SaveStats
from .loader import CheckpointReader
from .pipeline import Job, Pipeline
from .plan import Planner, flatten
from .staging import HostArena, Slot
from .tiers import ShmTier
from .storage import Storage, open_storage

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

    def __init__(self, config: CheckpointConfig, *, storage: Storage | None = None, distributed: bool = False,
                 group: Any = None) -> None:
        """``distributed=True``: every rank of ``group`` (default: world) constructs this together and
        calls ``save``/``load`` with the same replicated state; the ranks share the copies and writes."""
        self._pipeline: Pipeline | None = None  # set last: close() is safe on a half-built object
        if not isinstance(config, CheckpointConfig):
            raise ConfigError(f"Checkpointer needs a CheckpointConfig, got {type(config).__name__}")
        self.config = config
        p = config.persist
        self.storage = storage or open_storage(config.root, config.storage_options, direct_io=p.direct_io,
                                               fsync=p.fsync, workers=p.workers)
        self._planner = Planner(p.chunk_bytes)
        st = config.staging
        self._shm = ShmTier(st.shm_dir, self.storage.url) if st.shm else None
        self._arena = HostArena(st.slots, st.max_host_bytes, self._shm)
        self._watched: weakref.WeakSet = weakref.WeakSet()
        self._hooks: list[WatchHandle] = []
        self._lock = threading.Lock()
        self._pending: list[SaveHandle] = []
        self._errors: list[tuple[SaveHandle, FastCkptError]] = []
        self._catalog = Catalog(self.storage)
        self._copy_stream: Any = None
        self.stats: list[SaveStats] = []
        self._coord = Coordinator(group) if distributed else None
        if self._coord is not None and st.when_busy == "skip":
            # ranks deciding to skip independently would leave the commit protocol waiting on each other
            raise ConfigError("staging.when_busy=skip cannot be used with distributed=True (ranks could disagree); use wait")
        self._pipeline = Pipeline(self.storage, self._arena, p.workers, self._on_commit, self._on_failure,
                                  self._coord)
        self._atexit = _exit_flusher(self)
        _register_exit_hook(self._atexit)
        self.recovered: list[SaveHandle] = self._recover() if self._shm is not None else []

    def _recover(self) -> list[SaveHandle]:
        """Persist snapshots that a crashed process had staged in shared memory."""
        handles = []
        for rec in self._shm.orphans():  # type: ignore[union-attr]
            log.warning("fastckpt: recovering checkpoint %r (step %d) staged in shared memory by a crashed "
                        "process", rec.name, rec.step)
            slot = Slot(plan=rec.plan, ring=False, pinned=False, dir=rec.dir, recovered=True)
            for shard in rec.plan.shards:
                keep, buf = ShmTier.alloc(rec.dir, shard.index, shard.nbytes)
                slot._keep.append(keep)
                slot._buffers[shard.index] = buf
            handle = SaveHandle(name=rec.name, step=rec.step, path=rec.dirpath,
                                stats=SaveStats(step=rec.step, name=rec.name), _on_error_seen=self._mark_seen)
            job = Job(handle, rec.plan, slot, [], rec.keys, rec.numpy, rec.tree, rec.objects, rec.dirpath,
                      time.perf_counter(), uid=rec.uid)
            with self._lock:
                self._pending.append(handle)
            self._pipeline.submit_recovered(job)  # type: ignore[union-attr]
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

    def save(self, state: Any, step: int, *, name: str | None = None) -> SaveHandle:
        """Snapshot ``state``; returns once eager tensors are copied (milliseconds)."""
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
        objects = dumps_objects(flat.objects, self.config.allowed_classes) if flat.objects else None
        lazy_ptrs = self._lazy_ptrs()
        plan = self._planner.plan(flat, lambda t: t.data_ptr() in lazy_ptrs)
        if self._coord is not None:
            self._coord.assign(plan)
        pin = any(t.is_cuda for t in flat.tensors)
        dirpath = self.storage.join(self.storage.url, name)
        stats = SaveStats(step=step, name=name)
        handle = SaveHandle(name=name, step=step, path=dirpath, stats=stats, _on_error_seen=self._mark_seen)
        slot = self._arena.acquire(plan, pin, block=self.config.staging.when_busy == "wait")
        if slot is None:
            return self._skipped(handle, t0)
        job = Job(handle, plan, slot, flat.tensors, flat.keys, flat.numpy, flat.tree, objects, dirpath, t0)
        if self._coord is not None:
            job.uid = self._coord.next_uid()
        if pin:
            self._prepare_cuda(job)
        with self._lock:
            self._pending.append(handle)
        try:
            self._pipeline.stage_now(job, plan.mine([s for s in plan.shards if not s.lazy]))  # type: ignore[union-attr]
        except BaseException as e:
            job.error, job.reported = e, True  # the committer cleans up and frees the slot
            self._pipeline.submit(job, [])  # type: ignore[union-attr]
            raise FastCkptError(f"staging checkpoint {name!r} failed: {e}") from e
        if pin:  # the next forward (BatchNorm stats) must not overwrite what the copy reads
            for ev in job.shard_events.values():
                torch.cuda.current_stream().wait_event(ev)
        lazy = plan.mine([s for s in plan.shards if s.lazy])
        if not lazy:
            stats.staging_ms = (time.perf_counter() - t0) * 1e3
            handle._cuda_events = list(job.shard_events.values())
        self._pipeline.submit(job, lazy)  # type: ignore[union-attr]
        stats.blocking_ms = (time.perf_counter() - t0) * 1e3
        return handle

    def _prepare_cuda(self, job: Job) -> None:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream()
        job.copy_stream = self._copy_stream
        job.cuda_ready = torch.cuda.Event()
        job.cuda_ready.record(torch.cuda.current_stream())
        self._copy_stream.wait_event(job.cuda_ready)

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

    def _lazy_ptrs(self) -> set[int]:
        if self.config.staging.mode != "lazy":
            return set()
        # Addresses, not tensor objects: state_dict() hands out detached aliases. A tensor is
        # lazy only if it starts exactly where a watched param/state tensor starts.
        ptrs: set[int] = set()
        for opt in list(self._watched):
            for group in opt.param_groups:
                ptrs.update(p.data_ptr() for p in group["params"])
            for st in opt.state.values():
                ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        ptrs.discard(0)
        return ptrs

    def pending_names(self) -> list[str]:
        """Names of saves submitted but not yet committed or failed, oldest first."""
        with self._lock:
            return [h.name for h in self._pending]

    def wait_staged(self) -> None:
        """Block until every pending snapshot is in host memory (call before mutating)."""
        with self._lock:
            pending = list(self._pending)
        for h in pending:
            h.wait_staged()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every pending save is committed; raises a background error once."""
        with self._lock:
            pending = list(self._pending)
        wait_futures([h._durable for h in pending], timeout)
        self._raise_pending()

    # ---- background callbacks (committer thread) -----------------------------------

    def _on_commit(self, job: Job, info: CheckpointInfo) -> None:
        self._catalog.committed(info)
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
        """Committed checkpoints under ``root``, oldest step first."""
        self._check_open()
        return self._catalog.list()

    def latest(self) -> int | None:
        """Newest committed step, or None."""
        infos = self.list()
        return infos[-1].step if infos else None

    def exists(self, name: str) -> bool:
        """Whether a checkpoint named ``name`` is committed."""
        return self._catalog.info(self._check_name(name)) is not None

    def reader(self, step: int | None = None, *, name: str | None = None) -> CheckpointReader:
        """A reader for one committed checkpoint (the latest by default)."""
        self._check_open()
        target = self._check_name(name) if name is not None else self._catalog.resolve(step)
        return CheckpointReader(self.storage, self.storage.join(self.storage.url, target),
                                verify=self.config.persist.verify_on_load, workers=self.config.persist.workers,
                                allowed_classes=self.config.allowed_classes, coord=self._coord)

    def load(self, step: int | None = None, *, name: str | None = None, map_location: Any = None) -> Any:
        """Rebuild a saved state (the latest committed by default); tensors on CPU unless ``map_location``."""
        return self.reader(step, name=name).load(map_location)

    def load_into(self, target: Any, step: int | None = None, *, name: str | None = None) -> Any:
        """Copy a saved state into ``target``'s tensors in place."""
        return self.reader(step, name=name).load_into(target)

    def delete(self, name: str) -> Future:
        """Delete a committed checkpoint after every save submitted before this call."""
        self._check_open()
        name = self._check_name(name)
        if not self._leader:
            done: Future = Future()
            done.set_result(None)  # rank 0 deletes for everyone
            return done
        return self._pipeline.run_in_order(lambda: self._catalog.delete(name))  # type: ignore[union-attr]

    def _apply_retention(self) -> None:
        if self._leader:
            with self._lock:
                pending = {h.name for h in self._pending}
            self._catalog.retain(self.config.retention, pending)

    # ---- lifecycle -----------------------------------------------------------------

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
        with self._lock:
            pending = list(self._pending)
        wait_futures([h._durable for h in pending], timeout)
        for wh in self._hooks:
            wh.remove()
        pipeline.close()
        self._arena.close()
        self._raise_pending()

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


def _register_exit_hook(hook: Any) -> None:
    """Run ``hook`` at exit while our I/O executor still accepts work.

    ``atexit`` handlers run after threading's exit hooks, and one of those shuts down every
    ``concurrent.futures`` executor, so a lazy copy still pending would fail to queue its
    writes. ``threading._register_atexit`` hooks run newest first, before that one.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(hook)
            return
        except RuntimeError:  # shutdown already started
            pass
    atexit.register(hook)


def _exit_flusher(ckpt: Checkpointer) -> Any:
    ref = weakref.ref(ckpt)

    def flush() -> None:
        obj = ref()
        if obj is None or obj._pipeline is None:
            return
        n = len(obj._pending)
        if n:
            log.warning("fastckpt: interpreter exiting, flushing %d pending checkpoint(s) (up to %.0fs)", n, _EXIT_FLUSH_S)
        try:
            obj.close(timeout=_EXIT_FLUSH_S)
        except Exception as e:  # noqa: BLE001 - report, never raise at exit
            log.error("fastckpt: pending checkpoint failed at exit: %s", e)

    return flush
