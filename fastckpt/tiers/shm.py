"""The shared-memory tier: staged snapshots that outlive a crashed training process.

With ``staging.shm: true`` the staging buffers are files in ``/dev/shm`` (tmpfs), laid
out as ``<shm_dir>/fastckpt-<hash(root)>[-rank<r>]/<owner>/slot-<n>/``. The namespace is
one per root (and per rank), and ``<owner>`` names one ``ShmTier`` of one process by its
pid, the process's start time and a random nonce, so two Checkpointers never share a
folder, and a pid reused after a crash is not mistaken for the dead owner.

Before ``wait_staged()`` returns, a ``staged.json`` record (``fastckpt.format.shm_record``)
with the checksums of the staged bytes is renamed into the slot folder. If the process
dies before the snapshot commits, the next ``Checkpointer`` on the same root finds the
record, sees that its owner is gone, verifies the bytes and persists them. When the
snapshot commits, the record is renamed ``committed.json``: a process restarted after a
crash loads that checkpoint from these buffers (``fastckpt.tiers.shm_load``). When it fails,
the record is removed; either record is gone before the buffers are reused.

Every page of a buffer is reserved (``posix_fallocate``) when the buffer is made (engine/staging.py's
``Slot.buffer``: an eager shard's inside ``save()``, a lazy shard's on the copy thread): on a full tmpfs that
raises ``StorageError`` (from ``save()``, or for that save at the next save/wait/close), where a sparse file would
let the copy fault with SIGBUS and kill training.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import shutil
import uuid
from typing import Any, Callable, Iterator

import torch

from ..errors import FastCkptError, IntegrityError, StorageError, UnsafeCheckpointError
from ..format.paths import confine
from ..format.shm_record import COMMITTED, RECORD, StagedRecord, decode_record, encode_record
from ..engine.staging import Slot, staged_crcs
from .shm_trust import (ALIVE, check_entry, check_namespace, lock_held, open_buffer, open_buffer_fd, open_trusted,
                        read_record)

__all__ = ["ShmTier", "StagedRecord"]

log = logging.getLogger("fastckpt")

_OWNER_RE = re.compile(r"^(\d+)-(\d+)-([0-9a-f]{8})$")
_LOCK = "recovery.lock"


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None if
    there is no such process. With no ``/proc`` at all, 0 for any live pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def _buffer_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


class ShmTier:
    """Owns this process's folder in the root's namespace; finds and checks what dead owners left."""

    def __init__(self, shm_dir: str, root_url: str, *, rank: int = 0, world: int = 1, distributed: bool = False,
                 join: Callable[..., str] = os.path.join) -> None:
        """``join`` is the root's ``Storage.join``: a record's checkpoint folder is rebuilt with it."""
        digest = hashlib.sha1(root_url.encode()).hexdigest()[:16]
        self.root, self._join, self.shm_dir = root_url, join, shm_dir
        self.base = os.path.join(shm_dir, f"fastckpt-{digest}" + (f"-rank{rank}" if distributed else ""))
        self.rank, self.world = rank, world
        self._me = (os.getpid(), _start_time(os.getpid()) or 0)
        self.owner = f"{self._me[0]}-{self._me[1]}-{uuid.uuid4().hex[:8]}"
        self.dir = os.path.join(self.base, self.owner)
        self._count = 0
        self._alive_fd: int | None = None
        # Called with each job whose record is in place, before wait_staged() returns (the persister process is
        # told then, so a snapshot staged before a crash is committed by it: fastckpt.tiers.persister).
        self.on_record: Callable[[Any], None] | None = None

    @classmethod
    def for_root(cls, shm_dir: str, storage: Any, coord: Any = None) -> "ShmTier":
        """The tier of a ``Checkpointer`` writing ``storage``'s root: one namespace per root and rank, so ranks
        sharing a machine never mix records (``coord``: the ``Coordinator`` with ``distributed=True``)."""
        return cls(shm_dir, storage.url, join=storage.join, rank=coord.rank if coord else 0,
                   world=coord.world if coord else 1, distributed=coord is not None)

    @classmethod
    def trusted(cls, shm_dir: str, storage: Any, coord: Any = None) -> "ShmTier | None":
        """``for_root``'s tier, or None if its namespace is not this user's alone (another uid made it, or could
        replace it): nothing there is recovered or loaded, and the ``Checkpointer`` stages in ordinary host memory,
        said once, loudly. A ``shm_dir`` that cannot be used at all still raises ``StorageError``."""
        tier = cls.for_root(shm_dir, storage, coord)
        try:
            tier.open_namespace()
        except UnsafeCheckpointError as e:
            log.warning("fastckpt: staging.shm is off for this Checkpointer: %s. Nothing staged there is recovered "
                        "or loaded; snapshots are staged in ordinary host memory (a crash loses what is not yet on "
                        "disk)", e)
            return None
        return tier

    def open_namespace(self) -> None:
        """Create this root's namespace (``0700``) if it is missing and check that only this user could have put
        anything in it (``fastckpt.tiers.shm_trust``): ``UnsafeCheckpointError`` naming the folder if not (the
        ``Checkpointer`` then stages in ordinary memory), ``StorageError`` if ``shm_dir`` cannot be used at all."""
        try:
            check_namespace(self.shm_dir, self.base)
        except UnsafeCheckpointError:
            raise
        except OSError as e:
            raise StorageError(f"cannot open the shared-memory namespace {self.base}: {e}. Check staging.shm_dir "
                               "(a writable tmpfs), or set staging.shm: false") from e

    def _claim(self) -> None:
        """Create this owner's folder holding a locked ``alive.lock``. It is built under a temporary name
        and renamed into place, so no scanner ever sees the folder without its lock."""
        tmp = os.path.join(self.base, f".new-{self.owner}")
        self.open_namespace()
        os.mkdir(tmp, 0o700)
        fd = open_trusted(os.path.join(tmp, ALIVE), os.O_RDWR | os.O_CREAT | os.O_EXCL, "owner's lock file")
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, self.dir)
        self._alive_fd = fd

    def _owner_alive(self, m: re.Match, path: str) -> bool:
        """Whether the owner of ``path`` (its name matched by ``_OWNER_RE``) still runs."""
        if (int(m.group(1)), int(m.group(2))) == self._me:
            return True  # this process; opening its lock file would drop its lock (POSIX semantics)
        return lock_held(path)

    # ---- this process's slots -------------------------------------------------------

    def new_slot_dir(self) -> str:
        """Called by the arena when it creates a slot: a fresh folder only this tier uses."""
        self._count += 1
        path = os.path.join(self.dir, f"slot-{self._count}")
        try:
            if self._alive_fd is None:
                self._claim()
            os.mkdir(path, 0o700)
        except (OSError, UnsafeCheckpointError) as e:
            raise StorageError(f"cannot create the shared-memory staging folder {path}: {e}. Check staging.shm_dir "
                               "(a writable tmpfs), or set staging.shm: false") from e
        return path

    def alloc(self, slot_dir: str, index: int, nbytes: int) -> tuple[object, torch.Tensor]:
        """A shared, file-backed buffer that survives the process, its pages reserved now."""
        path = os.path.join(slot_dir, _buffer_name(index))
        size = max(nbytes, 1)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise self._no_room(path, size, e) from e
        try:
            os.ftruncate(fd, size)
            # A sparse tmpfs file faults in pages on first write; on a full tmpfs that fault is
            # SIGBUS in the copy. Reserving them here turns it into ENOSPC, raised by save().
            if hasattr(os, "posix_fallocate"):  # Linux; elsewhere the sparse file stays
                os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except OSError as e:
            _unlink(path)
            raise self._no_room(path, size, e) from e
        finally:
            os.close(fd)
        return mm, torch.frombuffer(mm, dtype=torch.uint8)

    def _no_room(self, path: str, size: int, e: OSError) -> StorageError:
        hint = " (the tmpfs is full)" if e.errno in (errno.ENOSPC, errno.ENOMEM) else ""
        return StorageError(
            f"cannot reserve {size} bytes of shared memory for staging buffer {path}{hint}: {e}. Free space under "
            f"{self.shm_dir} (staging.shm_dir), enlarge it (mount -o remount,size=...), or set staging.shm: false")

    def write_record(self, job: Any) -> None:
        """Called by the thread that finished staging ``job``, before ``wait_staged()`` returns: from now
        on a crash loses nothing staged."""
        slot_dir = job.slot.dir
        tmp = os.path.join(slot_dir, RECORD + ".tmp")
        try:
            _unlink(tmp)  # left by a write that failed: O_EXCL below creates the file afresh, never through a link
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                           "wb") as f:
                f.write(encode_record(job, self.owner, self.rank, self.world))
            os.replace(tmp, os.path.join(slot_dir, RECORD))
            if self.on_record is not None:
                self.on_record(job)
        except OSError as e:
            _unlink(tmp)
            raise StorageError(f"cannot write the shared-memory record of checkpoint {job.handle.name!r} in "
                               f"{slot_dir}: {e}; it would not survive a crash. Free space under the shm_dir or "
                               "set staging.shm: false") from e

    @staticmethod
    def clear_record(slot_dir: str) -> None:
        """Called when the job failed, and before the slot's buffers are reused: no record, committed or
        not, may describe bytes that are about to change."""
        _unlink(os.path.join(slot_dir, RECORD))
        _unlink(os.path.join(slot_dir, COMMITTED))

    @staticmethod
    def mark_committed(slot_dir: str) -> None:
        """Called when the job committed: its record becomes ``committed.json``, so that a process restarted
        after a crash can load that checkpoint from these buffers (never recover it again)."""
        try:
            os.replace(os.path.join(slot_dir, RECORD), os.path.join(slot_dir, COMMITTED))
        except FileNotFoundError:
            pass

    @staticmethod
    def remove(slot_dir: str) -> None:
        """Drop a slot folder (its buffers are unmapped when the arena lets go of them)."""
        shutil.rmtree(slot_dir, ignore_errors=True)

    def close(self) -> None:
        """Called by the arena's ``close``: this process's folder goes, and so do dead owners' folders
        emptied by recovery."""
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._alive_fd is not None:
            os.close(self._alive_fd)
            self._alive_fd = None
        for _, path in self._dead_owners():
            for slot_dir in _slots(path):  # committed snapshots kept for loading: their memory goes back now
                if check_entry(os.path.join(slot_dir, COMMITTED), False, "shared-memory record"):
                    self.remove(slot_dir)
            _sweep(path)

    # ---- what dead owners left ----------------------------------------------------------

    @contextlib.contextmanager
    def recovering(self) -> Iterator[None]:
        """Held by a ``Checkpointer`` while it recovers: two processes starting at once on one root (and
        rank) never both adopt a snapshot. The kernel drops the lock if the holder dies."""
        self.open_namespace()
        try:
            fd = open_trusted(os.path.join(self.base, _LOCK), os.O_RDWR | os.O_CREAT, "recovery lock")
        except (OSError, UnsafeCheckpointError) as e:
            raise StorageError(f"cannot open the shared-memory namespace {self.base}: {e}. Check staging.shm_dir "
                               "(a writable tmpfs), or set staging.shm: false") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def orphans(self) -> list[StagedRecord]:
        """Validated records left by dead owners, oldest step first. A bad record is discarded with a
        warning naming it; folders of dead owners with no record (staging never finished) are removed."""
        found: list[StagedRecord] = []
        for owner, path in self._dead_owners():
            for slot_dir in _slots(path):
                rec = self._adopt(owner, slot_dir)
                if rec is not None:
                    found.append(rec)
            _sweep(path)
        return sorted(found, key=lambda r: (r.step, r.uid))

    def _dead_owners(self) -> Iterator[tuple[str, str]]:
        for owner in _listdir(self.base):
            path = os.path.join(self.base, owner)
            m = _OWNER_RE.match(owner)
            if m is None:
                if owner != _LOCK and not owner.startswith(".new-"):  # a lock, or an owner being created
                    log.warning("fastckpt: ignoring %s: not a shared-memory staging folder of fastckpt", path)
                continue
            if not check_entry(path, True, "shared-memory owner folder"):  # a link, a file, a FIFO, another uid's
                continue
            if owner != self.owner and not self._owner_alive(m, path):
                yield owner, path

    def _adopt(self, owner: str, slot_dir: str) -> StagedRecord | None:
        source = os.path.join(slot_dir, RECORD)
        try:
            confine(self.base, slot_dir, "shared-memory slot folder")
            data = read_record(source)
            if data is None:
                if not os.path.exists(os.path.join(slot_dir, COMMITTED)):  # kept: a load may use it
                    self.remove(slot_dir)  # crashed before staging finished: nothing was promised
                return None
            return decode_record(data, slot_dir, source, root=self.root, join=self._join,
                                 owner=owner, rank=self.rank, world=self.world)
        except FastCkptError as e:
            self.discard(slot_dir, e)
            return None

    def committed(self) -> Iterator[StagedRecord]:
        """Validated records of committed snapshots still held by dead owners' slots (``fastckpt.tiers.shm_load``);
        a record that fails validation is skipped with a warning, its slot left to ``close``."""
        for owner, path in self._dead_owners():
            for slot_dir in _slots(path):
                source = os.path.join(slot_dir, COMMITTED)
                if not os.path.lexists(source):
                    continue
                try:
                    confine(self.base, slot_dir, "shared-memory slot folder")
                    data = read_record(source)
                    if data is not None:
                        yield decode_record(data, slot_dir, source, root=self.root, join=self._join,
                                            owner=owner, rank=self.rank, world=self.world)
                except FastCkptError as e:
                    log.warning("fastckpt: ignoring the committed snapshot at %s: %s", slot_dir, e)

    def buffer_files(self, rec: StagedRecord) -> dict[int, int]:
        """Open ``rec``'s shard buffers read-only (descriptors the caller closes), with ``_open_buffer``'s checks.
        A restarted process copies out of them with ``pread``: no mapping to fault in page by page and
        tear down afterwards (1.48 GB: 0.15-0.16 s against 0.18-0.19 s copied out of a fresh mapping, plus
        ~45 ms of unmapping, both with the CRC of every step; shared 2-core VM)."""
        out: dict[int, int] = {}
        try:
            for shard in rec.plan.mine(rec.plan.shards):
                out[shard.index] = open_buffer_fd(os.path.join(rec.dir, _buffer_name(shard.index)), shard.nbytes,
                                                   os.O_RDONLY)
        except BaseException:
            for fd in out.values():
                os.close(fd)
            raise
        return out

    def discard(self, slot_dir: str, why: BaseException | str) -> None:
        """Drop a staged snapshot that will not be recovered, loudly."""
        log.warning("fastckpt: discarding the snapshot staged in shared memory at %s, which is NOT recovered: %s",
                    slot_dir, why)
        if os.path.islink(slot_dir):
            _unlink(slot_dir)
        else:
            self.remove(slot_dir)

    def open_slot(self, rec: StagedRecord, verify: bool = True) -> Slot:
        """The recovered slot of ``rec``: its existing buffers, checked against the record's checksums (``verify``
        False: the persister process, told by a live training process that staged them a moment ago)."""
        slot = Slot(plan=rec.plan, ring=False, pinned=False, dir=rec.dir, recovered=True)
        for shard in rec.plan.mine(rec.plan.shards):
            keep, buf = open_buffer(os.path.join(rec.dir, _buffer_name(shard.index)), shard.nbytes)
            slot.adopt(shard.index, buf, keep)
            if not verify:
                continue
            got = staged_crcs(buf, shard)
            for e, want, have in zip(shard.entries, rec.crcs[shard.index], got):
                if want != have:
                    raise IntegrityError(
                        f"{rec.dir}: tensor {rec.keys[e.index]!r} of {rec.label} does not match the checksum "
                        f"recorded when it was staged (crc32c {have:#010x}, expected {want:#010x}); the shared "
                        "memory was altered")
        return slot


def _slots(owner_dir: str) -> Iterator[str]:
    """The slot folders of a dead owner's folder that this user made (``check_entry``); its lock file is not one."""
    for slot in _listdir(owner_dir):
        path = os.path.join(owner_dir, slot)
        if slot != ALIVE and check_entry(path, True, "shared-memory slot folder"):
            yield path


def _sweep(owner_dir: str) -> None:
    """Remove a dead owner's folder once no slot is left in it."""
    if set(_listdir(owner_dir)) <= {ALIVE}:
        alive = os.path.join(owner_dir, ALIVE)
        if os.path.lexists(alive) and not check_entry(alive, False, "owner's lock file"):
            return  # not ours to remove: the folder stays, warned of
        _unlink(alive)
        try:
            os.rmdir(owner_dir)
        except OSError:
            pass


def _listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _unlink(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
