"""Several framework files in one folder, saved by one engine job, with a ``manifest.json`` written last.

A framework such as Accelerate saves a checkpoint as a folder of files in its own formats
(``model.safetensors``, ``optimizer.bin``, ...). ``FileBundle`` treats the folder like one save: each member
file is a format (``SafetensorsFileFormat`` or ``TorchFileFormat``) that decides its header/skeleton and where
its tensors go; the engine stages every member's tensors into one host slot and the committer writes:

0. each torch member with a ``PickleLoader`` (``loaders``): its pickle is unpickled as that loader will read it
   (``fastckpt.format.picklecheck``); a refusal fails the save, naming the file and the key paths at fault;
1. ``.fastckpt-pending`` (a marker: "fastckpt is writing this folder"), and removes an older ``manifest.json``;
2. each member file atomically (temporary name, then rename), computing its CRC32C while writing;
3. ``manifest.json`` (``"layout": "files"``: every member's size and CRC32C): the commit point;
4. removes the marker.

A crash anywhere before 3 leaves the marker and no manifest: fastckpt never takes the folder as committed.

A folder the caller created (``made``: Accelerate's ``save_state`` folders) gets its marker, and loses an older
manifest, inside the save call (``mark``), so a copy taken right after the call is visibly incomplete. In a local
one, step 2 writes every member unnamed (``O_TMPFILE``) and step 3 names them all at once, then the manifest, each
name after a check that the marker and the names before it are still there (``_write_then_link``). If the user
removes that folder before the commit (a ``TemporaryDirectory`` cleanup), their removal wins: the save stops with
``FolderRemovedError`` (quiet: the saver warns once and does not raise it later), and whatever a storage's
``makedirs`` recreated meanwhile is removed again (``_undo_recreation``).

A ``staged`` folder (Accelerate's ``complete_folders``) is written as above under a hidden sibling name
(``staging_path``), which the caller created, and renamed to its own name once committed (``placing.rename_into_place``):
until then the folder's own name does not exist, so a copy taken too early fails ("No such file or directory")
instead of copying a marker. The rename yields to a removal in this process exactly as the links do.
"""
from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import functools
import json
import os
import time
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch

from .bundlededup import upload_records, write_member
from .checksum import crc32c
from .contenthash import FIELD
from .external import EXTERNAL, ExternalFile
from ..errors import FolderRemovedError, UnsafeCheckpointError
from .layout import FORMAT, LAYOUT_FILES, MANIFEST, CheckpointInfo, FileRecord
from .paths import plain_name
from .placing import PENDING, NotPlaced, rename_into_place, unmark
from .picklecheck import PickleLoader, check_loads, culprits, pickle_of
from .safetensorsfile import SafetensorsFileFormat
from ..storage.heldlink import present, wait_unwalked
from ..storage.local import LocalStorage
from ..storage.protocol import Storage
from .torchfile import TorchFileFormat, plan_torch_file

__all__ = ["EXTERNAL", "FileBundle", "PENDING", "SAFETENSORS", "STAGING_PREFIX", "TORCH", "staging_path"]

# A staged folder's hidden name: ``.fastckpt-staging-0.checkpoint_12``. A leading dot: fastckpt's listings, gc and
# retention skip it. The first run of digits is 0: stock Accelerate (run without fastckpt on the same project) orders
# folders by their name's first number, so a killed save's leftover sorts oldest: its total_limit removes it first and
# its load_state() never takes it for the newest checkpoint.
STAGING_PREFIX = ".fastckpt-staging-0."
SAFETENSORS, TORCH = "safetensors", "torch"
Member = Union[SafetensorsFileFormat, TorchFileFormat, ExternalFile]


@dataclass(eq=False)
class FileBundle:
    """How the pipeline writes one folder of files: table entries ``starts[k]..`` belong to member ``k``."""

    dirpath: str
    name: str
    step: int
    names: list[str]
    members: list[Member]
    starts: list[int]  # first table index of each member
    user: dict[str, Any]
    made: bool = False  # the caller created the folder: if it vanishes (the user removed it) the save fails
    # torch member name -> (the loader that will read it, the object saved): checked by the committer, before
    # anything is written. The object is only walked again when its loader refuses the file, to name the keys.
    checks: dict[str, tuple[PickleLoader, Any]] = field(default_factory=dict)
    # (path, inode, device) of the made folder and its parents when planned: a folder with another identity later
    # was removed (and recreated by a storage's makedirs, or by the user).
    identities: tuple[tuple[str, int, int], ...] = ()
    marked = False  # PENDING written and the older manifest removed (by ``mark``)
    health: dict[str, Any] | None = None  # the save's health record (format/health.py), set at the commit
    catalogued = True  # a checkpoint of the root like save()'s: listed, retained and uploaded by its manifest
    keeps_shards = True  # the member files are written at the commit, from the slot
    dedup: Any = None  # the save's copy source on an object store (bundlededup.py), set at the commit
    publish_as: str = ""  # staged: the folder's own path; ``dirpath`` (its staging path) is renamed to it at commit

    @classmethod
    def plan(cls, files: dict[str, tuple[str, Any]], dirpath: str, name: str, step: int, storage: Storage,
             user: dict[str, Any] | None = None, made: bool = False,
             loaders: dict[str, PickleLoader] | None = None, staged: bool = False,
             ) -> tuple["FileBundle", list[torch.Tensor], list[str], list[Any]]:
        """``files``: file name -> (``SAFETENSORS`` with a dict of tensors | ``TORCH`` with any object);
        ``loaders``: torch file name -> the loader that will read it (checked before the commit); ``staged`` (with
        ``made``, a local folder): written in ``staging_path(dirpath)``, which the caller created, and renamed to
        ``dirpath`` once committed. Returns the bundle, the tensors to stage, their keys and the tensors whose
        versions the guard watches."""
        publish_as = ""
        if staged:
            if not made or "://" in dirpath:
                raise ValueError(f"{dirpath}: only a local folder the caller created can be staged")
            publish_as, dirpath = dirpath, staging_path(dirpath)
        members: list[Member] = []
        tensors: list[torch.Tensor] = []
        keys: list[str] = []
        sources: list[Any] = []
        starts: list[int] = []
        for fname, (kind, obj) in files.items():
            plain_name(fname, "bundle file", dirpath)
            path = storage.join(dirpath, fname)
            starts.append(len(tensors))
            if kind == EXTERNAL:  # written by another save (every rank's parts): waited for at the commit
                members.append(ExternalFile(path, obj))
            elif kind == SAFETENSORS:
                fmt, ts, ks = SafetensorsFileFormat.plan(obj, path, metadata={"format": "pt"})
                members.append(fmt)
                tensors += ts
                sources += ts
                keys += [f"{fname}/{k}" for k in ks]
            else:
                tfmt, ts, ks, srcs = TorchFileFormat.plan(obj, path)
                members.append(tfmt)
                tensors += ts
                sources += srcs
                keys += [f"{fname}/{k}" for k in ks]
        checks = {n: (loader, files[n][1]) for n, loader in (loaders or {}).items()
                  if n in files and files[n][0] == TORCH}
        bundle = cls(dirpath, name, step, list(files), members, starts, dict(user or {}), made, checks=checks,
                     identities=_identities(dirpath) if made else (), publish_as=publish_as)
        return bundle, tensors, keys, sources

    @property
    def size(self) -> int:
        return sum(_size(m) for m in self.members)

    def _member_of(self, index: int) -> int:
        return bisect.bisect_right(self.starts, index) - 1

    def value_dtype(self, entry: Any) -> torch.dtype:
        """The dtype of a staged entry's values (its health statistics), as its member file knows it."""
        k = self._member_of(entry.index)
        of = getattr(self.members[k], "value_dtype", None)
        return of(_Shifted(entry, self.starts[k])) if of is not None else entry.dtype

    def checksum(self, data: memoryview, entries: Any) -> dict[int, int]:
        """Called by an I/O worker: each record's CRC-32 that its torch file's zip fields need (0 otherwise)."""
        out: dict[int, int] = {}
        for e in entries:
            k = self._member_of(e.index)
            local = _Shifted(e, self.starts[k])
            out.update({e.index: c for c in self.members[k].checksum(data, [local]).values()})
        return out

    def write_shard(self, storage: Storage, snap: Any, shard: Any, data: memoryview) -> tuple[int, FileRecord, list[int]]:
        """``FileFormat``: called by an I/O worker once a shard is staged; checksums it (the commit writes it)."""
        crcs = self.checksum(data, shard.entries)
        return shard.index, FileRecord("", 0, 0), [crcs[e.index] for e in shard.entries]

    def commit(self, storage: Storage, snap: Any, results: Any, staged: Any,
               pool: Executor | None = None) -> tuple[CheckpointInfo, int]:
        """``FileFormat``: called by the committer; writes the member files and then the manifest (the commit)."""
        self.check_pickles(storage)
        views, crcs = staged()
        self.health, self.dedup = snap.health_doc, getattr(snap, "dedup", None)
        size = self.write(storage, views, crcs, pool)
        return CheckpointInfo(snap.name, snap.step, self.publish_as or self.dirpath, size,
                              healthy=None if self.health is None else self.health["healthy"]), size

    def check_pickles(self, storage: Storage) -> None:
        """Each torch member with a loader, unpickled as that loader will read it (storages on the meta device);
        ``UnsafeCheckpointError`` naming the file, what its loader refused, the key paths at fault and the fix.
        Run by the committer before anything of the folder is written: a save that could not be loaded never
        commits, and the error is logged then and raised by the next save or ``wait()``."""
        for k, fname in enumerate(self.names):
            if fname not in self.checks:
                continue
            loader, obj = self.checks[fname]
            member = self.members[k]
            assert isinstance(member, TorchFileFormat)
            try:
                check_loads(pickle_of(member.layout), loader)
            except Exception as e:  # the unpickler raises UnpicklingError, RuntimeError, TypeError, ...
                bad = culprits(obj, loader, lambda value: pickle_of(plan_torch_file(value)))
                where = f" the values at fault: {', '.join(bad)};" if bad else ""
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise UnsafeCheckpointError(
                    f"{storage.join(self.dirpath, fname)}: {loader.reader} would refuse to load this file ({reason});"
                    f"{where} {loader.fix}. Nothing of this checkpoint was committed") from e

    def discard(self, storage: Storage, snap: Any) -> None:
        """``FileFormat``: nothing to remove: each member appears by rename, and the pending marker stays so that
        the folder is never taken as committed."""

    def mark(self, storage: Storage) -> None:
        """Called inside the save call: the folder shows ``PENDING`` and no older manifest from now until the
        commit, so a copy or an upload made before the commit is refused by every fastckpt reader."""
        try:
            self._check_folder(storage)
            storage.write_atomic(storage.join(self.dirpath, PENDING), b"fastckpt is writing this folder\n")
            storage.delete(storage.join(self.dirpath, MANIFEST))  # an older save of this folder is being replaced
            self.marked = True
        except FolderRemovedError:
            raise
        except Exception as e:
            self._removed_or_raise(storage, e)
            raise

    def write(self, storage: Storage, views: dict[int, memoryview], crcs: dict[int, int],
              pool: Executor | None = None) -> int:
        """Write every member (in parallel on ``pool``, the idle I/O workers), then the manifest: the commit point.
        Returns the bytes written."""
        try:
            if not self.marked:  # a made folder was marked inside the save call: writing again would race a removal
                self.mark(storage)
            if self.made and self.identities and isinstance(storage, LocalStorage) and not any(
                    isinstance(m, ExternalFile) for m in self.members):  # linking would write an external one empty
                records = self._write_then_link(storage, views, crcs, pool)
            else:
                records = _every(pool, functools.partial(self._write_member, storage, views, crcs),
                                 range(len(self.members)))
                self._check_folder(storage)
                self._publish(storage, MANIFEST, self.manifest(records))  # <- the commit point
            unmark(storage, self.dirpath, self.made and bool(self.identities) and isinstance(storage, LocalStorage))
            if self.publish_as:  # the marker goes before: the folder takes its name without it
                rename_into_place(storage, self.dirpath, self.publish_as, self.name, records)
        except FolderRemovedError:
            self._undo_recreation(storage)
            raise
        except Exception as e:
            if not self.publish_as or not isinstance(e, NotPlaced):
                self._removed_or_raise(storage, e)
            raise
        return sum(r.size for r in records)

    def _write_then_link(self, storage: LocalStorage, views: dict[int, memoryview], crcs: dict[int, int],
                         pool: Executor | None) -> list[FileRecord]:
        """A made local folder: every member written complete but unnamed first (``O_TMPFILE``), then all named at
        once, the manifest last. Until then the folder holds only the marker: a user's ``rmtree`` that lists it
        removes all there is, and sees the marker gone before any name appears; the window in which a name could
        appear under a removal already listed shrinks from the whole write to a few links."""
        opened: list[int] = []

        def stage(k: int) -> tuple[int | None, FileRecord, list[memoryview]]:
            parts, record = self._member_parts(views, crcs, k)
            record = replace(record, hashes=upload_records(parts, self.dedup))  # the remote tier's copy source
            self._check_folder(storage)
            fd = storage.write_unnamed(self.dirpath, parts)  # None: no O_TMPFILE here, named at the link
            if fd is not None:
                opened.append(fd)
            return fd, record, parts

        try:
            staged = _every(pool, stage, range(len(self.members)))
            manifest = self.manifest([record for _, record, _ in staged])
            last = storage.write_unnamed(self.dirpath, [memoryview(manifest)])
            if last is not None:
                opened.append(last)
            # From here on only checks and links: the names appear together, each checked right before it.
            names = self.names + [MANIFEST]
            real = os.path.realpath(self.dirpath)
            files = [(fd, parts) for fd, _, parts in staged] + [(last, [memoryview(manifest)])]
            for k, (fd, parts) in enumerate(files):
                if k in (0, len(staged)):  # each run of links that keeps the GIL: the members, then the manifest
                    wait_unwalked(real)
                if fd is None:  # no O_TMPFILE: a named temporary file (the marker checked before the rename)
                    self._publish(storage, names[k], parts)
                    continue
                # The folder is synced once after the last member (every member named durably before the manifest
                # is), then after the manifest's name: the commit point.
                storage.link_unnamed(fd, storage.join(self.dirpath, names[k]),
                                     functools.partial(self._still_whole, storage, names[:k]),
                                     sync_folder=k >= len(staged) - 1)
        finally:
            for held in opened:
                os.close(held)
        return [record for _, record, _ in staged]

    def _write_member(self, storage: Storage, views: dict[int, memoryview], crcs: dict[int, int],
                      k: int) -> FileRecord:
        parts, record = self._member_parts(views, crcs, k)
        if isinstance(self.members[k], ExternalFile):
            return record  # its own save wrote it
        self._check_folder(storage)
        hashes = write_member(storage, storage.join(self.dirpath, self.names[k]), parts, self.dedup)
        if hashes is None:
            self._publish(storage, self.names[k], parts)
            hashes = upload_records(parts, self.dedup)  # a local root the remote tier uploads with dedup
        return replace(record, hashes=hashes)

    def _member_parts(self, views: dict[int, memoryview], crcs: dict[int, int],
                      k: int) -> tuple[list[memoryview], FileRecord]:
        """Member ``k``'s bytes (views of the slot) and its record (size, CRC32C)."""
        if isinstance(self.members[k], ExternalFile):
            return [], self.members[k].record(self.names[k])
        start, end = self.starts[k], self.starts[k + 1] if k + 1 < len(self.starts) else None
        mine = [i for i in views if i >= start and (end is None or i < end)]
        local_crcs = {i - start: crcs[i] for i in mine if i in crcs}
        parts = self.members[k].parts({i - start: views[i] for i in mine}, local_crcs)
        crc = 0
        for p in parts:
            crc = crc32c(p, crc)
        return parts, FileRecord(self.names[k], sum(len(p) for p in parts), crc)

    def _publish(self, storage: Storage, name: str, data: Any) -> None:
        """Write ``name`` atomically. In a made local folder, right before the file takes its name, check that the
        marker ``mark`` wrote is still there: a user's ``rmtree`` of the folder removes it first or soon, and a name
        created after the removal listed the folder would make that removal fail ("Directory not empty")."""
        path = storage.join(self.dirpath, name)
        parts = [memoryview(data)] if isinstance(data, bytes) else data
        if self.made and self.identities and isinstance(storage, LocalStorage):
            storage.write_file_atomic(path, parts, before_publish=functools.partial(self._still_marked, storage),
                                      create_folder=False)
        else:
            storage.write_file_atomic(path, parts)

    def _still_marked(self, storage: Storage) -> None:
        # present(): the GIL held, so a user's rmtree in this process cannot run between this check and the link
        if not present(storage.join(self.dirpath, PENDING)):
            raise FolderRemovedError(f"{self.dirpath} is being removed (its {PENDING} marker is gone) while its "
                                     f"checkpoint {self.name!r} was being written; the save is abandoned")

    def _still_whole(self, storage: Storage, linked: list[str]) -> None:
        """Before the next name: the marker and every name linked so far still there. A user's rmtree unlinks what
        it listed one by one, and whichever of ours goes first says it is under way: no name after it."""
        self._still_marked(storage)
        for name in linked:
            if not present(storage.join(self.dirpath, name)):
                raise FolderRemovedError(f"{self.dirpath} is being removed ({name} is gone) while its checkpoint "
                                         f"{self.name!r} was being written; the save is abandoned")

    def _check_folder(self, storage: Storage) -> None:
        # Writing would recreate a folder the user deleted (a test's temporary directory, a cleanup script).
        if self._removed(storage):
            raise FolderRemovedError(f"{self.dirpath} was removed before its checkpoint {self.name!r} was written; "
                                     "the save is abandoned and nothing is recreated there")

    def _removed(self, storage: Storage) -> bool:
        """Whether the made folder was removed: once marked, its marker is gone (an inode number alone is no proof:
        a folder recreated at once may reuse it); before, it is gone or another folder."""
        if not (self.made and self.identities):
            return False
        if self.marked:
            return not storage.exists(storage.join(self.dirpath, PENDING))
        return _identities(self.dirpath)[:1] != self.identities[:1]

    def _removed_or_raise(self, storage: Storage, error: BaseException) -> None:
        """A write failed: if the folder went away meanwhile, that is the user's removal winning (quiet)."""
        if self._removed(storage):
            self._undo_recreation(storage)
            raise FolderRemovedError(f"{self.dirpath} was removed while its checkpoint {self.name!r} was being "
                                     "written; the save is abandoned and nothing is recreated there") from error

    def _undo_recreation(self, storage: Storage) -> None:
        """Remove what this save put in a folder (and parents) that a storage's ``makedirs`` recreated after the
        user removed them: only our own names, and only folders that are then empty (never the user's files).
        ``LocalStorage`` never recreates a made folder (``create_folder=False``): nothing to undo, and a folder
        still there is one the user's ``rmtree`` is removing right now (removing it under them would fail it)."""
        if isinstance(storage, LocalStorage):
            return
        known = set(self.names) | {PENDING, MANIFEST}
        for level, (path, ino, dev) in enumerate(self.identities):
            try:
                st = os.stat(path)
            except OSError:
                continue  # still gone: nothing of ours there
            if level and (st.st_ino, st.st_dev) == (ino, dev):
                return  # the user's folder, untouched from here up (the folder itself: its marker said it went)
            with contextlib.suppress(OSError):
                for entry in os.listdir(path):
                    if entry in known or ".fastckpt-tmp-" in entry or ".tmp-" in entry and entry.split(".tmp-")[0] in {
                            PENDING, MANIFEST}:
                        os.unlink(os.path.join(path, entry))
                os.rmdir(path)
            known = set()  # parents hold only the folder we just removed

    def manifest(self, records: list[FileRecord]) -> bytes:
        doc = {"format": FORMAT, "version": 1, "layout": LAYOUT_FILES, "name": self.name, "step": self.step,
               "created": time.time(), "nbytes": sum(r.size for r in records),
               "files": {r.name: _listed(r) for r in records}, "user": self.user}
        if self.health is not None:
            doc["health"] = self.health
        return json.dumps(doc, indent=1).encode()


def staging_path(dirpath: str) -> str:
    """Where a staged folder is written until its commit: a hidden sibling (``STAGING_PREFIX`` + its name)."""
    parent, name = os.path.split(os.path.abspath(dirpath))
    return os.path.join(parent, STAGING_PREFIX + name)


@dataclass(frozen=True)
class _Shifted:
    """A table entry seen with its member's local index (the member's formats index their own records)."""

    entry: Any
    start: int

    @property
    def index(self) -> int:
        return self.entry.index - self.start

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.entry, attr)


def _every(pool: Executor | None, fn: Any, indices: range) -> list[FileRecord]:
    """``fn`` on each index (in parallel on ``pool``); every call has ended before an error is raised, so nothing
    writes into the folder after a failure (an abandoned save's clean-up must come last)."""
    if pool is None:
        return [fn(i) for i in indices]
    futures = [pool.submit(fn, i) for i in indices]
    concurrent.futures.wait(futures)
    return [f.result() for f in futures]


def _identities(dirpath: str) -> tuple[tuple[str, int, int], ...]:
    """(path, inode, device) of ``dirpath`` and each existing parent, innermost first; () if ``dirpath`` is gone."""
    out = []
    path = os.path.abspath(dirpath)
    while True:
        try:
            st = os.stat(path)
        except OSError:
            if not out:
                return ()
        else:
            out.append((path, st.st_ino, st.st_dev))
        parent = os.path.dirname(path)
        if parent == path:
            return tuple(out)
        path = parent


def _listed(r: FileRecord) -> dict[str, Any]:
    """A member's manifest entry: size, CRC32C and, with dedup (an object store, or uploads), its content records."""
    return {"size": r.size, "crc32c": r.crc32c, **({FIELD: r.hashes} if r.hashes else {})}


def _size(member: Member) -> int:
    return member.size if isinstance(member, (SafetensorsFileFormat, ExternalFile)) else member.layout.size
