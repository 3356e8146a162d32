"""The persister process (``persist.process``): it writes, fsyncs and commits the snapshots a training process staged.

Started by ``fastckpt.tiers.persister`` as ``python -m fastckpt.tiers.persister_main FD OPTIONS``, one per
``Checkpointer``, it reads the staged bytes from the shared-memory buffers (``fastckpt.tiers.shm``) and runs the
same ``Pipeline`` the thread path runs, so the files are the same bytes. Messages on the socket ``FD`` (pickled
tuples, from its own parent only): ``("staged", slot, uid, records)`` when a snapshot's record is in place (``records``:
whether its shards list content records, as the parent's saver decided), ``("commit", slot,
uid)`` once its seal passed, ``("drop", slot, uid)`` when it was refused, ``None`` to stop. It answers each commit
with ``("done", uid, info, written_bytes, health_doc)`` or ``("failed", uid, message)``.

When the socket closes without ``None`` the training process died: every snapshot told "staged" and not yet
committed or dropped is verified against its record's checksums and committed (what a restarted process's
recovery would do, ``fastckpt.tiers.recovery``), holding the namespace's recovery lock meanwhile, then it exits.
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from ..engine.affinity import usable
from ..engine.handle import SaveHandle, SaveStats
from ..engine.pipeline import Job, Pipeline
from ..engine.priority import ThreadPriorities
from ..engine.staging import HostArena
from ..errors import FastCkptError
from ..format.shm_record import RECORD, StagedRecord, decode_record
from ..storage.local import LocalStorage
from .shm import ShmTier
from .shm_trust import open_trusted, read_record

log = logging.getLogger("fastckpt")

PROCESS_NAME = b"ckpt-persister"  # what ps, top and /proc/<pid>/comm show (15 bytes at most)
_PR_SET_NAME = 15
_LOCK = "recovery.lock"  # fastckpt.tiers.shm's lock: held while a restarted process recovers


class GatedPipeline(Pipeline):
    """The thread pipeline, with each job's shards written as soon as they are staged and its commit held until the
    training process says the seal passed (``open_gate``), as the thread path writes before the seal."""

    def submit_gated(self, job: Job) -> None:
        job.handle.mark_staged()
        for shard in job.plan.mine(job.plan.shards):
            job.writes.append(self._writers().submit(self._write_shard, job, shard))
        self._commit_q.put(job)

    @staticmethod
    def open_gate(job: Job, error: BaseException | None = None) -> None:
        """Commit ``job`` (or, with ``error``, discard its files quietly: the training process refused it)."""
        if error is not None:
            job.error, job.retaken = error, True  # retaken: no failure reported, nobody waits for it
        job.handle.sealed_now()


class PersisterServer:
    """The persister's main loop: messages in, commits out, through one thread-path ``Pipeline``."""

    def __init__(self, conn: Connection, opts: dict[str, Any]) -> None:
        self.conn = conn
        self.opts = opts
        self.storage = LocalStorage(opts["root"], direct_io=opts["direct_io"], fsync=opts["fsync"])
        self.priorities = ThreadPriorities(opts["priority"])  # raised and lowered as the parent's are
        self.pipeline = GatedPipeline(self.storage, HostArena(1, None), opts["workers"], self._committed,
                                      self._failed, priorities=self.priorities)
        self.pipeline.cpu_threads(opts.get("cpu_threads", "auto"))  # the training process's count (persister.py)
        cpus = opts.get("background_cpus", "all")  # resolved by the training process (persister.py)
        self.pipeline.placement.follow(cpus if cpus == "all" or set(cpus) <= set(usable()) else "all", lambda: 1)
        self.tier = ShmTier(opts["shm_dir"], self.storage.url, join=self.storage.join)  # opens nothing by itself
        # told "staged", not yet committed or dropped: uid -> its job and record
        self.jobs: dict[str, tuple[Job, StagedRecord]] = {}
        self.unreadable: dict[str, str] = {}  # uid -> why its staged snapshot could not be read
        self._send_lock = threading.Lock()
        self._parent_alive = True

    def run(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                self._parent_alive = False
                break
            if msg is None:
                break
            kind, slot_dir, uid, *more = msg
            if kind == "staged":
                self._staged(slot_dir, uid, *more)
            elif kind == "raise":
                self.priorities.raise_("the training process waits", behind=False)
            elif kind == "settle":
                self.priorities.settle()
            elif kind in ("commit", "drop"):
                job, _ = self.jobs.pop(uid, (None, None))
                if job is not None:
                    self.pipeline.open_gate(job, None if kind == "commit" else FastCkptError("refused"))
                elif kind == "commit":
                    self._send(("failed", uid, self.unreadable.pop(uid, f"the persister was never told of {uid}")))
                self.unreadable.pop(uid, None)
        if not self._parent_alive and self.jobs:
            self._orphans()
        for job, _ in self.jobs.values():  # closed with saves pending (close(timeout) expired): not committed
            self.pipeline.open_gate(job, FastCkptError("closed"))
        self.pipeline.close()

    def _orphans(self) -> None:
        """The training process died: commit what it staged, checked against its record as a restarted process's
        recovery would check it, holding the namespace's recovery lock so that no restarted process adopts them."""
        base = os.path.dirname(os.path.dirname(next(iter(self.jobs.values()))[1].dir))
        fd = open_trusted(os.path.join(base, _LOCK), os.O_RDWR | os.O_CREAT, "recovery lock")
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.priorities.raise_("the training process died", behind=False)  # a restart waits for this lock
        try:
            for job, rec in self.jobs.values():
                try:
                    self.tier.open_slot(rec, verify=True)  # the bytes still match the checksums taken at staging
                    self.pipeline.open_gate(job)
                except (FastCkptError, OSError) as e:
                    log.error("fastckpt: the persister does NOT commit %s: %s", rec.label, e)
                    self.pipeline.open_gate(job, e)
            self.jobs.clear()
            self.pipeline.close()  # every commit done before the lock goes
        finally:
            os.close(fd)

    def _staged(self, slot_dir: str, uid: str, records: bool) -> None:
        try:
            rec = self._record(slot_dir, uid)
            slot = self.tier.open_slot(rec, verify=False)  # staged a moment ago by the live training process
        except (FastCkptError, OSError) as e:
            log.error("fastckpt: the persister cannot read the snapshot staged at %s: %s", slot_dir, e)
            self.unreadable[uid] = f"the persister process could not read the snapshot staged at {slot_dir}: {e}"
            return
        handle = SaveHandle(name=rec.name, step=rec.step, path=rec.dirpath,
                            stats=SaveStats(step=rec.step, name=rec.name))
        job = Job(handle=handle, plan=rec.plan, slot=slot, tensors=[], keys=rec.keys, numpy=rec.numpy, tree=rec.tree,
                  objects=rec.objects, dirpath=rec.dirpath, t0=time.perf_counter(), uid=rec.uid,
                  dtensors=rec.dtensors, staged_crcs=rec.crcs)
        job.health = {} if self.opts["health"] else None
        job.records = records
        self.jobs[uid] = (job, rec)
        self.pipeline.submit_gated(job)

    def _record(self, slot_dir: str, uid: str) -> StagedRecord:
        source = os.path.join(slot_dir, RECORD)
        data = read_record(source)
        if data is None:
            raise FastCkptError(f"{source} is missing: the staged snapshot's record was removed")
        rec = decode_record(data, slot_dir, source, root=self.storage.url, join=self.storage.join,
                            owner=os.path.basename(os.path.dirname(slot_dir)), rank=0, world=1)
        if rec.uid != uid:
            raise FastCkptError(f"{source} holds snapshot {rec.uid}, not {uid}: the slot was reused")
        return rec

    def _committed(self, job: Job, info: Any) -> None:
        ShmTier.mark_committed(job.slot.dir or "")  # never recovered again; a restart may load it from memory
        self._send(("done", job.uid, info, job.handle.stats.written_bytes, job.health_doc))

    def _failed(self, job: Job, err: FastCkptError) -> None:
        log.error("fastckpt: the persister process failed to commit %r: %s", job.handle.name, err)
        self._send(("failed", job.uid, str(err)))

    def _send(self, msg: Any) -> None:
        if not self._parent_alive:
            return
        with self._send_lock:
            try:
                self.conn.send(msg)
            except OSError:
                self._parent_alive = False  # nobody to tell; the commits go on


def _name_process() -> None:
    try:
        ctypes.CDLL(None).prctl(_PR_SET_NAME, PROCESS_NAME, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the command line still names it


def main(argv: list[str]) -> int:
    # Ctrl-C reaches the whole foreground group; a snapshot staged before it must still commit (the parent
    # also starts it in a session of its own). SIGTERM stays fatal: an operator's way to stop it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _name_process()
    logging.basicConfig(format="%(message)s")
    opts = json.loads(argv[1])
    PersisterServer(Connection(int(argv[0])), opts).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
