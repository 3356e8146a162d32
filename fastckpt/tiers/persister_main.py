"""The persister process (``persist.process``): it writes, fsyncs and commits the snapshots a training process staged.

Started by ``fastckpt.tiers.persister`` as ``python -m fastckpt.tiers.persister_main FD OPTIONS``, one per
``Checkpointer``, it reads the staged bytes from the shared-memory buffers (``fastckpt.tiers.shm``) and runs the
same ``Pipeline`` the thread path runs, so the files are the same bytes. Messages on the socket ``FD`` (pickled
tuples, from its own parent only): ``("staged", slot, uid)`` when a snapshot's record is in place, ``("commit", slot,
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

PROCESS_NAME = b"fastckpt-persist"  # what ps, top and /proc/<pid>/comm show (15 bytes at most)
_PR_SET_NAME = 15
_LOCK = "recovery.lock"  # fastckpt.tiers.shm's lock: held while a restarted process recovers


class PersisterServer:
    """The persister's main loop: messages in, commits out, through one thread-path ``Pipeline``."""

    def __init__(self, conn: Connection, opts: dict[str, Any]) -> None:
        self.conn = conn
        self.opts = opts
        self.storage = LocalStorage(opts["root"], direct_io=opts["direct_io"], fsync=opts["fsync"])
        self.priorities = ThreadPriorities(opts["priority"])  # raised and lowered as the parent's are
        self.pipeline = Pipeline(self.storage, HostArena(1, None), opts["workers"], self._committed, self._failed,
                                 priorities=self.priorities)
        self.tier = ShmTier(opts["shm_dir"], self.storage.url, join=self.storage.join)  # opens nothing by itself
        self.staged: dict[str, str] = {}  # uid -> slot folder: told "staged", not yet committed or dropped
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
            kind, slot_dir, uid = msg
            if kind == "staged":
                self.staged[uid] = slot_dir
            elif kind == "raise":
                self.priorities.raise_("the training process waits", behind=False)
            elif kind == "settle":
                self.priorities.settle()
            elif kind == "drop":
                self.staged.pop(uid, None)
            elif kind == "commit":
                self.staged.pop(uid, None)
                self._submit(slot_dir, uid, verify=False)
        if not self._parent_alive and self.staged:
            self._orphans()
        self.pipeline.close()

    def _orphans(self) -> None:
        """The training process died: commit what it staged, as a restarted process's recovery would."""
        base = os.path.dirname(os.path.dirname(next(iter(self.staged.values()))))
        fd = open_trusted(os.path.join(base, _LOCK), os.O_RDWR | os.O_CREAT, "recovery lock")
        fcntl.flock(fd, fcntl.LOCK_EX)  # a restarted process recovering now would adopt the same snapshots
        self.priorities.raise_("the training process died", behind=False)  # a restart waits for this lock
        try:
            for uid, slot_dir in self.staged.items():
                self._submit(slot_dir, uid, verify=True)
            self.pipeline.close()  # every commit done before the lock goes
        finally:
            os.close(fd)

    def _submit(self, slot_dir: str, uid: str, *, verify: bool) -> None:
        try:
            rec = self._record(slot_dir, uid)
            if rec is None:
                return  # a restarted process recovered it first (its record is gone)
            slot = self.tier.open_slot(rec, verify)
        except (FastCkptError, OSError) as e:
            log.error("fastckpt: the persister cannot commit the snapshot staged at %s: %s", slot_dir, e)
            self._send(("failed", uid, f"the persister process could not read the snapshot staged at {slot_dir}: "
                                       f"{e}"))
            return
        handle = SaveHandle(name=rec.name, step=rec.step, path=rec.dirpath,
                            stats=SaveStats(step=rec.step, name=rec.name))
        job = Job(handle=handle, plan=rec.plan, slot=slot, tensors=[], keys=rec.keys, numpy=rec.numpy, tree=rec.tree,
                  objects=rec.objects, dirpath=rec.dirpath, t0=time.perf_counter(), uid=rec.uid,
                  dtensors=rec.dtensors, staged_crcs=rec.crcs)
        job.health = {} if self.opts["health"] else None
        self.pipeline.submit_recovered(job)

    def _record(self, slot_dir: str, uid: str) -> StagedRecord | None:
        source = os.path.join(slot_dir, RECORD)
        data = read_record(source)
        if data is None:
            if self._parent_alive:
                raise FastCkptError(f"{source} is missing: the staged snapshot's record was removed")
            return None
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
