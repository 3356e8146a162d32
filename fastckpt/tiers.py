"""The shared-memory tier: staged snapshots that outlive a crashed training process.

With ``staging.shm: true`` the staging buffers are files in ``/dev/shm`` (tmpfs).
As soon as a snapshot is fully staged, a small ``staged.json`` record describing
it (layout, tree, objects) is renamed into place next to the buffers. If the
process dies before the snapshot reaches storage, the next ``Checkpointer`` on the
same root finds the record, checks that its owner is gone, and persists and
commits the snapshot from shared memory, so the crash loses no checkpoint that
was already staged. The record is removed once the snapshot commits or fails.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import mmap
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from .plan import Plan, Shard, TensorEntry

__all__ = ["ShmTier", "StagedRecord"]

log = logging.getLogger("fastckpt")

RECORD = "staged.json"


@dataclass
class StagedRecord:
    """A staged, uncommitted snapshot found in shared memory."""

    dir: str
    name: str
    step: int
    uid: str
    dirpath: str
    tree: Any
    objects: bytes | None
    keys: list[str]
    numpy: list[bool]
    plan: Plan
    dtensors: list[dict[str, Any]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmTier:
    """Owns ``<shm_dir>/fastckpt-<hash(root)>/``: one folder per (process, slot)."""

    def __init__(self, shm_dir: str, root_url: str) -> None:
        digest = hashlib.sha1(root_url.encode()).hexdigest()[:16]
        self.base = os.path.join(shm_dir, f"fastckpt-{digest}")
        self._count = 0

    def new_slot_dir(self) -> str:
        """Called by the arena when it creates a slot."""
        self._count += 1
        path = os.path.join(self.base, f"{os.getpid()}-{self._count}")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    @staticmethod
    def alloc(slot_dir: str, index: int, nbytes: int) -> tuple[object, torch.Tensor]:
        """A shared, file-backed buffer that survives the process."""
        path = os.path.join(slot_dir, f"shard-{index:05d}.bin")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return mm, torch.frombuffer(mm, dtype=torch.uint8)

    @staticmethod
    def write_record(slot_dir: str, job: Any) -> None:
        """Called once a job is fully staged: from now on it is recoverable."""
        plan: Plan = job.plan
        doc = {
            "pid": os.getpid(), "name": job.handle.name, "step": job.handle.step, "uid": job.uid,
            "dirpath": job.dirpath, "tree": job.tree, "numpy": job.numpy, "keys": job.keys,
            "objects": base64.b64encode(job.objects).decode() if job.objects is not None else None,
            "entries": [[str(e.dtype).removeprefix("torch."), list(e.shape), e.nbytes, e.lazy, e.shard, e.offset]
                        for e in plan.entries],
            "shards": [[s.index, s.nbytes, s.lazy] for s in plan.shards],
            "dtensors": job.dtensors,
        }
        tmp = os.path.join(slot_dir, RECORD + ".tmp")
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, os.path.join(slot_dir, RECORD))

    @staticmethod
    def clear_record(slot_dir: str) -> None:
        """Called when the job committed or failed."""
        try:
            os.remove(os.path.join(slot_dir, RECORD))
        except FileNotFoundError:
            pass

    def orphans(self) -> list[StagedRecord]:
        """Records left by dead processes, oldest step first. Folders of dead owners without one are removed."""
        found = []
        if not os.path.isdir(self.base):
            return found
        for sub in sorted(os.listdir(self.base)):
            path = os.path.join(self.base, sub)
            pid = int(sub.split("-")[0]) if sub.split("-")[0].isdigit() else -1
            if pid == os.getpid() or (pid > 0 and _alive(pid)):
                continue
            try:
                with open(os.path.join(path, RECORD)) as f:
                    found.append(_parse(path, json.load(f)))
            except FileNotFoundError:
                shutil.rmtree(path, ignore_errors=True)  # crashed before staging finished: nothing to save
            except (ValueError, KeyError, TypeError) as e:
                log.warning("fastckpt: ignoring unreadable staged snapshot in %s: %s", path, e)
                shutil.rmtree(path, ignore_errors=True)
        return sorted(found, key=lambda r: r.step)

    @staticmethod
    def remove(slot_dir: str) -> None:
        shutil.rmtree(slot_dir, ignore_errors=True)


def _parse(path: str, doc: dict[str, Any]) -> StagedRecord:
    entries = [TensorEntry(i, getattr(torch, dt), tuple(shape), nbytes, lazy, shard, offset)
               for i, (dt, shape, nbytes, lazy, shard, offset) in enumerate(doc["entries"])]
    shards = [Shard(index=i, entries=[e for e in entries if e.shard == i], nbytes=n, lazy=lz)
              for i, n, lz in doc["shards"]]
    for s in shards:
        s.entries.sort(key=lambda e: e.offset)
    plan = Plan(key=("recovered", path), entries=entries, shards=shards, total_bytes=sum(s.nbytes for s in shards))
    objects = base64.b64decode(doc["objects"]) if doc["objects"] is not None else None
    return StagedRecord(path, doc["name"], int(doc["step"]), doc["uid"], doc["dirpath"], doc["tree"], objects,
                        list(doc["keys"]), list(doc["numpy"]), plan, list(doc.get("dtensors") or []))
