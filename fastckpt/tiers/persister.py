"""The persister process of ``persist.process``: staged snapshots written and committed outside the training process.

With ``staging.shm`` the training process only copies each snapshot into its shared-memory slot, takes the
CRC32C of what it staged and writes the slot's record (``fastckpt.tiers.shm``); the writes, fsyncs and the commit
run in one long-lived child process (``fastckpt.tiers.persister_main``, named ``ckpt-persister``), so they no
longer share the training process's GIL. The child is told "staged" before ``wait_staged()`` returns and "commit"
once the seal passed; if training dies in between, the child commits what was staged anyway.

If the child dies, the saves it was told to commit fail with a ``StorageError`` naming it (raised once at the next
save/wait/close, as every background error), and later saves are written by this process's threads.
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, Callable

from ..config import CheckpointConfig
from ..engine.distributed import Coordinator
from ..engine.affinity import resolve
from ..engine.cpugate import auto_limit
from ..engine.pipeline import Job, Pipeline
from ..errors import StorageError
from ..format.openlayout import OPEN_LAYOUT
from ..format.protocol import ShardResult
from ..format.layout import CheckpointInfo
from ..storage.local import LocalStorage
from ..storage.protocol import Storage
from .shm import ShmTier

__all__ = ["AUTO_MIN_BYTES", "Persister", "PersistedPipeline", "pipeline_for"]

log = logging.getLogger("fastckpt")
_ids = itertools.count(1)

# persist.process "auto": states at least this big go to the persister process, smaller ones stay on the threads.
# Measured (docs/DESIGN.md, "The persister process"; benchmarks/persister.py): the process lost at 1.6 MB and 63 MB
# (its hops between processes cost more than the work it moves) and won at 328 MB (the writes, fsyncs and health
# statistics no longer share the training process's GIL).
AUTO_MIN_BYTES = 256 * 1024 * 1024
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Persister:
    """This process's end of one persister process: spawned on first use, stopped by ``close``."""

    def __init__(self, storage: LocalStorage, config: CheckpointConfig) -> None:
        p = config.persist
        self.opts = {"root": storage.url, "direct_io": p.direct_io, "fsync": p.fsync, "workers": p.workers,
                     "priority": p.priority, "health": config.health.enabled, "shm_dir": config.staging.shm_dir,
                     # resolved here: the child cannot see how many threads training uses (engine/cpugate.py)
                     "cpu_threads": auto_limit() if p.cpu_threads == "auto" else p.cpu_threads}
        # its threads run where this process's background threads would (engine/affinity.py): resolved here too
        cpus = resolve(p.background_cpus, self.opts["cpu_threads"])
        self.opts["background_cpus"] = sorted(cpus) if cpus is not None else "all"
        self.proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._futures: dict[str, tuple[str, Future]] = {}  # uid -> (checkpoint name, its commit's future)
        self.reader: threading.Thread | None = None  # reads the child's answers; ends when the child does
        self._lock = threading.Lock()  # sends (copy thread, committer) and the futures table
        self.dead: str | None = None  # why the child is gone, once it is
        self._closing = False

    @property
    def alive(self) -> bool:
        return self.dead is None and not self._closing

    def start(self) -> None:
        """Spawn the child if it is not running yet (a fork and exec: it imports torch on its own time)."""
        with self._lock:
            if self.proc is not None or not self.alive:
                return
            mine, theirs = socket.socketpair()
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "fastckpt.tiers.persister_main", str(theirs.fileno()),
                     json.dumps(self.opts)], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env,
                    start_new_session=True)  # Ctrl-C and the job's SIGHUP do not reach it: it outlives training
            except OSError as e:
                mine.close()
                self.dead = f"could not be started ({e})"
                log.warning("fastckpt: the persister process %s; saves are written by this process's threads",
                            self.dead)
                return
            finally:
                theirs.close()
            self._conn = Connection(mine.detach())
            os.register_at_fork(after_in_child=functools.partial(_forget_in_child, weakref.ref(self)))
            self.reader = threading.Thread(target=self._read_loop, name=f"fastckpt-persister-{next(_ids)}", daemon=True)
            self.reader.start()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def staged(self, slot_dir: str, uid: str, records: bool) -> None:
        """Called by the copy thread once ``uid``'s record is in place, before ``wait_staged()`` returns; ``records``:
        the save's shards list content records (the saver decided: ``Job.records``)."""
        self._send(("staged", slot_dir, uid, records))

    def priority(self, raised: bool) -> None:
        """Called when this process's background threads are raised (saves pending, a ``wait()``) or settle: the
        persister's threads follow, as the thread path's would."""
        if self.proc is not None:
            self._send(("raise" if raised else "settle", "", ""))

    def drop(self, slot_dir: str, uid: str) -> None:
        self._send(("drop", slot_dir, uid))

    def commit(self, slot_dir: str, uid: str, name: str) -> Future:
        """Called by the committer once checkpoint ``name``'s seal passed: resolves to ``(info, written_bytes,
        health_doc)``, or fails with a ``StorageError``."""
        fut: Future = Future()
        with self._lock:
            self._futures[uid] = (name, fut)
        self._send(("commit", slot_dir, uid))
        return fut

    def _send(self, msg: Any) -> None:
        with self._lock:
            conn = self._conn
            if conn is None or self.dead is not None:
                self._fail_all()
                return
            try:
                conn.send(msg)
            except OSError:
                pass  # the reader sees the end of the socket and says why

    def _read_loop(self) -> None:
        conn = self._conn
        assert conn is not None and self.proc is not None
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind, uid, *rest = msg
            with self._lock:
                _, fut = self._futures.pop(uid, (None, None))
            if fut is None:
                continue
            if kind == "done":
                fut.set_result(tuple(rest))
            else:
                fut.set_exception(StorageError(f"{rest[0]} (in the persister process, pid {self.proc.pid})"))
        code = self.proc.wait()
        with self._lock:
            if self._closing and code == 0:
                return
            self.dead = (f"the persister process ckpt-persister (pid {self.proc.pid}) died with exit code {code}"
                         f"{' (killed by signal ' + str(-code) + ')' if code < 0 else ''}")
            self._fail_all()
        log.warning("fastckpt: %s; the saves it had not committed failed, and later saves are written by this "
                    "process's threads. Look for its error above, or for the OOM killer in the kernel log", self.dead)

    def _fail_all(self) -> None:
        """With the lock held: every commit still awaited fails, naming the dead child."""
        why = self.dead or "the persister process is closed"
        for name, fut in self._futures.values():
            fut.set_exception(StorageError(f"checkpoint {name!r} was not committed: {why}. Save again: later saves "
                                           "are written by this process's threads"))
        self._futures.clear()

    def close(self, timeout: float | None) -> None:
        """Tell the child to stop once its commits are done, and wait for it (``timeout``: then leave it running,
        committing on its own)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            conn, proc = self._conn, self.proc
            if conn is not None and self.dead is None:
                try:
                    conn.send(None)
                except OSError:
                    pass
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("fastckpt: the persister process (pid %d) is still committing; it goes on alone",
                            proc.pid)
        if conn is not None:
            conn.close()


def _forget_in_child(ref: "weakref.ref[Persister]") -> None:
    """A fork()ed child (a DataLoader worker) must not keep the socket open: the persister learns of the training
    process's death from its end of the socket closing."""
    persister = ref()
    if persister is not None and persister._conn is not None:
        persister._conn.close()  # this child's copy of the descriptor only
        persister._conn = None


class PersistedPipeline(Pipeline):
    """The thread pipeline, except that the jobs it routes to the persister are written and committed there."""

    def __init__(self, *args: Any, persister: Persister, min_bytes: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.persister = persister
        self._min_bytes = min_bytes
        self._routes: "weakref.WeakKeyDictionary[Job, bool]" = weakref.WeakKeyDictionary()
        self._replies: dict[Job, tuple[CheckpointInfo, int, Any]] = {}
        shm = self._arena.shm
        assert isinstance(shm, ShmTier)
        shm.on_record = self._on_record
        self._priorities.on_change = persister.priority
        if min_bytes == 0:
            # "on": started now, so that it imports torch (seconds: 4.2 s on the shared 2-core VM) while the model is
            # built. Started by the first save (before), that import delayed the first commits, so the next saves
            # found their slots held and made new ones, then waited (H200: save() blocked 0.8, 1.1, 1.4 s, the
            # first commit took 6.8 s against 2.5 s on the threads). No integration gets an idle process: this
            # pipeline needs staging.shm, which save_file/save_files refuse. "auto" starts it at its first big save.
            persister.start()

    def routed(self, job: Job) -> bool:
        """Whether ``job`` goes to the persister, decided once, on the training thread (``save()``)."""
        got = self._routes.get(job)
        if got is None:
            # auto keeps CUDA states on the threads: on an H200 host (gpu_bench, 1.96 GB, 2026-11-26) the process
            # stalled training 1150 ms a checkpoint against the threads' 113 ms (each save waited for the shm CRCs
            # and the record); "on" still routes them
            got = (job.file_format is OPEN_LAYOUT and job.shared is None and job.slot.dir is not None
                   and not job.slot.ring and not job.slot.recovered and job.plan.total_bytes >= self._min_bytes
                   and not (self._min_bytes and job.cuda is not None) and self.persister.alive)
            if got:
                self.persister.start()
                got = self.persister.alive
            self._routes[job] = got
        return got

    def stage_now(self, job: Job, shards: list[Any]) -> None:
        self.routed(job)
        super().stage_now(job, shards)

    def submit(self, job: Job, lazy: list[Any]) -> None:
        self.routed(job)
        super().submit(job, lazy)

    def _on_record(self, job: Job) -> None:
        if self._routes.get(job):
            self.persister.staged(job.slot.dir or "", job.uid, job.records)
            if job.cuda is not None:
                # The record claims only checked bytes: every CUDA copy was seen done before its CRC. The thread
                # path times its CUDA copies where its writers wait for them; here the child writes, so time it now.
                job.handle.stats.staging_ms = (time.perf_counter() - job.t0) * 1e3

    def _write_shard(self, job: Job, shard: Any) -> ShardResult:
        if self._routes.get(job):
            return None  # type: ignore[return-value]  # the persister writes it; the buffer stays staged
        return super()._write_shard(job, shard)

    def _written(self, job: Job) -> list[ShardResult]:
        if not self._routes.get(job):
            return super()._written(job)
        self.await_seal(job)  # the seal passed: the snapshot may commit
        if job.error is not None:
            raise job.error
        for f in job.writes:
            f.result()
        self._replies[job] = self.persister.commit(job.slot.dir or "", job.uid, job.handle.name).result()
        return []

    def _commit(self, job: Job, results: list[ShardResult]) -> CheckpointInfo:
        reply = self._replies.pop(job, None)
        if reply is None:
            return super()._commit(job, results)
        info, written, job.health_doc = reply
        job.handle.stats.nbytes = info.nbytes
        job.handle.stats.written_bytes = written
        return info

    def _release(self, job: Job, committed: bool = False) -> None:
        self._replies.pop(job, None)
        if self._routes.get(job) and not committed:
            self.persister.drop(job.slot.dir or "", job.uid)  # before its record goes: never committed by the child
        super()._release(job, committed)

    def close(self, timeout: float | None = None) -> bool:
        drained = super().close(timeout)
        self.persister.close(timeout if drained else 0)
        return drained


def pipeline_for(config: CheckpointConfig, storage: Storage, shm: ShmTier | None,
                 coord: Coordinator | None) -> Callable[..., Pipeline]:
    """The pipeline class a ``Checkpointer`` runs: the thread pipeline, or with ``persist.process`` on or auto
    (and a plain local root, shared-memory staging, one process) the persisted one."""
    mode = config.persist.process
    if mode == "off":
        return Pipeline
    why = ("staging.shm is off or refused" if shm is None else "distributed=True" if coord is not None
           else f"the root {storage.url!r} is not a plain local folder" if type(storage) is not LocalStorage
           else None)
    if why is not None:
        if mode == "on":
            log.warning("fastckpt: persist.process is on, but %s: this Checkpointer's saves are written by its own "
                        "threads", why)
        return Pipeline
    assert isinstance(storage, LocalStorage)
    return functools.partial(PersistedPipeline, persister=Persister(storage, config),
                             min_bytes=0 if mode == "on" else AUTO_MIN_BYTES)

