"""One torch file on S3 uploaded by several data-parallel ranks: the parts of one multipart upload.

``sharedfile.py``'s protocol where the ranks cannot write into one file (an object store, or nodes with disks of
their own that share only a bucket). Rank 0's layout is the truth, as there; on the committer threads, over the
Coordinator's gloo group, once per save and in save order:

1. rank 0 creates the multipart upload of the final key (invisible until completed: the object under that key, if
   any, stays the previous one until the commit), writes its marker (``storage/s3parts.py``), and sends the upload
   id with its layout, or word that it failed;
2. every rank checks its records match rank 0's, and every rank's CRC-32s (or its error) go to rank 0;
3. rank 0 builds the fixed bytes (pickle, zip headers with the CRCs, central directory) and sends them to every
   rank with its verdict so far: every rank now computes the same part plan (``partplan.py``);
4. the record bytes a part's owner lacks go to it point to point (at most one part's worth per owner boundary);
5. every rank uploads its parts, each with its CRC32C (a part the store rejects as damaged is sent again);
   with ``remote.dedup`` the unchanged ranges are copied server-side from the folder's newest ``.ckpt`` instead
   (``shareddedup.py``: the record hashes travel with the CRCs in 2., rank 0's plan with the fixed bytes in 3.);
6. every rank's (part number, ETag, CRC32C) go to rank 0, which completes the upload (the commit) or aborts it;
7. rank 0's verdict goes to every rank: each raises the same error for the same file.

Any failure aborts the upload: rank 0 aborts on a failed verdict, and a rank that loses the others (a rank died:
gloo reports the broken connection) aborts it too, so no part outlives the save. A process killed between create and
abort leaves the upload and its marker; the next start (rank 0's first shared upload into the folder, the Lightning
plugin's first use of it, ``fastckpt gc``) aborts what the markers prove fastckpt's (``s3parts.sweep``). That includes
the survivor of a dead rank under Lightning's launcher: its child-process observer SIGKILLs rank 0 within 5 s of a
rank's death, which on a loaded host can come before rank 0's abort (tests/test_lightning_ddp_s3.py).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor
from typing import Any, Callable

import torch
import torch.distributed as dist

from .distributed import Coordinator
from .partplan import Fragment, Part, fragments, limits, part_plan
from .shareddedup import Copy, HashPart, expected_crc, owned, piece_crcs, plan_shared, staged_hashes
from .sharedfile import SharedFileWrite, raise_agreed
from ..errors import FastCkptError, StorageError
from ..format.checksum import combine
from ..format.health import HealthPart, content_tie, sidecar_bytes, sidecar_path, summarize
from ..format.torchfile import TorchFileFormat
from ..format.rootrecords import drop_records, save_records
from ..storage.s3checksum import part_bytes
from ..storage.s3parts import S3Parts, marker_path, sweep

__all__ = ["SharedObjectWrite", "can_share_object", "shared_write", "sweep_once"]

log = logging.getLogger("fastckpt")

_swept: set[str] = set()  # folders this process swept already: once per start
_swept_lock = threading.Lock()


def can_share_object(storage: Any) -> bool:
    """Whether ranks can upload the parts of one object in ``storage`` (S3: ``FsspecStorage.multipart``)."""
    multipart = getattr(storage, "multipart", None)
    return callable(multipart) and multipart() is not None


def sweep_once(storage: Any, grace_s: float | None) -> None:
    """Rank 0, before its first shared upload into ``storage.url`` in this process: abort the uploads an earlier,
    killed run left (``s3parts.sweep``)."""
    with _swept_lock:
        if storage.url in _swept:
            return
        _swept.add(storage.url)
    sweep(storage, storage.multipart(), grace_s)


class SharedObjectWrite(SharedFileWrite):
    """The commit protocol of one shared S3 object on one rank (called by the committer thread)."""

    def __init__(self, coord: Coordinator, storage: Any, fmt: TorchFileFormat, uid: str, writers: list[int],
                 name: str, step: int, keys: list[str], grace_s: float | None, dedup: bool = False) -> None:
        super().__init__(coord, storage, fmt, uid, writers, name)
        self.dedup = dedup  # remote.dedup: unchanged ranges copied server-side (shareddedup.py)
        self.hashed: dict[int, str] = {}  # rank 0: every rank's record hashes
        self.records: list[Any] | None = None  # rank 0: the new file's content records (its records sidecar)
        self.copied = 0  # bytes this rank's parts copied server-side instead of sending
        self.parts: S3Parts = storage.multipart()
        self.marker = marker_path(storage.url, uid)  # in the root, which the sweep reads, for a subfolder's object too
        self.step, self.keys, self.grace_s = step, keys, grace_s
        self.upload_id: str | None = None
        self.mine: list[int] = []  # the part numbers this rank uploaded
        self.size = fmt.layout.size  # rank 0's, once its fixed bytes are in
        self.tensors: dict[str, Any] = {}  # rank 0: every rank's tensor statistics (the sidecar's)
        self.digest: str | None = None  # rank 0: the file's content_tie, which its sidecar records

    def run(self, views: dict[int, memoryview], crcs: dict[int, int], error: BaseException | None,
            pool: Executor | None = None, health: dict[str, Any] | None = None,
            record: Callable[[dict[str, Any]], bytes] | None = None) -> int:
        """Every rank, the same collectives in the same order whatever fails; returns the object's size or raises
        the verdict (``StorageError``, the same text on every rank). ``record`` is ignored: an object's health
        record is its sidecar, written by rank 0 after the commit."""
        coord, layout = self.coord, self.fmt.layout
        mine = (self.fmt.signature(), self.writers, [r.offset for r in layout.records])
        if coord.rank == 0 and error is None:
            error = self._create()
        ref = self._guarded(coord.share, (mine, self.upload_id) if error is None else None)  # 1.
        local = error
        sent: dict[int, int] = {}
        if ref is not None:
            (ref, self.upload_id) = ref
            if local is None:
                try:
                    self._check(ref, mine)
                    sent = {i: crcs[i] for i in views}
                except BaseException as e:  # noqa: BLE001 - reported to rank 0 below, so no rank hangs
                    local = e
        parts = [sent] + ([HealthPart(health)] if health is not None else [])
        if self.dedup and local is None and ref is not None:
            parts.append(staged_hashes(views))
        merged, failed = self._guarded(coord.gather, parts, local)  # 2.
        fixed, dedup = None, None
        if coord.rank == 0:
            if failed is None and ref is None:
                failed = f"rank 0: {error}"
            try:  # rank 0 alone: whatever it raises must become the shared verdict (step 3), or the others hang
                if failed is None:
                    fixed, failed = self._fixed(merged)
                if failed is None and self.dedup:
                    dedup = self._plan(fixed)
            except Exception as e:  # noqa: BLE001 - shared below as every rank's verdict
                fixed, dedup, failed = None, None, f"rank 0 commit: {type(e).__name__}: {e}"
        fixed, failed, dedup = self._guarded(coord.share, (fixed, failed, dedup))  # 3.
        if fixed:
            self.size = max(off + len(b) for off, b in fixed)  # rank 0's file: its tail ends it
        done: list[Any] = []
        plan: list[Part] = []
        records: list[tuple[int, int, int]] = []
        copies: dict[int, Copy] = {}
        if failed is None and local is None:
            try:
                size = self.size
                records = [(off, r.nbytes, w) for r, w, off in zip(layout.records, ref[1], ref[2])]  # at its offsets
                if dedup is not None:
                    plan, copies = owned(dedup, records)
                else:
                    plan = part_plan(size, records, *limits(size, part_bytes(size)))
            except BaseException as e:  # noqa: BLE001 - reported to rank 0 below, so no rank hangs
                local = e
        if dedup is not None and failed is None:  # every rank alike: rank 0 copies, the rest is sent
            plan, failed, done = self._copy(plan, copies, fixed or [], records, views, local)
        if failed is None and local is None:
            try:
                received = self._exchange(fragments(plan, records), views)  # 4.
                done += self._upload(plan, fixed, records, views, received)  # 5.
            except BaseException as e:  # noqa: BLE001 - reported to rank 0 below, so no rank hangs
                local = e
                if isinstance(e, _LostRanks):
                    self._lost(e)
        merged, failed2 = self._guarded(coord.gather, [done], local)  # 6.
        if coord.rank == 0:
            failed = failed or failed2
            failed = self._finish(merged, failed, health is not None)
        verdict = self._guarded(coord.outcome, failed)  # 7.
        if verdict is not None:
            raise_agreed(self.name, self.fmt.path, verdict, local)
        return self.size

    # ---- rank 0 ----------------------------------------------------------------------------------------------

    def _create(self) -> BaseException | None:
        """Sweep (once per folder and process), create the upload, write its marker before any part goes up."""
        try:
            sweep_once(self.storage, self.grace_s)
            self.upload_id = self.parts.create(self.fmt.path)
            self.storage.write_atomic(self.marker, S3Parts.marker_bytes(self.fmt.path, self.upload_id))
            self.marked = True
        except BaseException as e:  # noqa: BLE001 - broadcast as rank 0's failure
            if self.upload_id is not None:
                self._abort()
            return e
        return None

    def _fixed(self, merged: list[Any]) -> tuple[list[tuple[int, bytes]] | None, str | None]:
        """Every record's CRC-32 in: the fixed bytes, CRC fields filled in (or the error text)."""
        crcs: dict[int, int] = {}
        for part in merged:
            if isinstance(part, HealthPart):
                self.tensors.update(part.tensors)
            elif isinstance(part, HashPart):
                self.hashed.update(part.hashes)
            else:
                crcs.update(part)
        missing = [i for i, r in enumerate(self.fmt.layout.records) if r.nbytes and i not in crcs]
        if missing:
            return None, f"rank 0 commit: no rank staged record data/{missing[0]} ({len(missing)} missing)"
        fixed = self.fmt.fixed(crcs)  # the tail is kept even when empty (a safetensors file): it ends the file
        self.digest = content_tie(self.fmt, crcs)  # what the health sidecar is tied to
        return [(off, bytes(b)) for k, (off, b) in enumerate(fixed) if len(b) or k == len(fixed) - 1], None

    def _plan(self, fixed: list[tuple[int, bytes]] | None) -> list[tuple[Any, ...]] | None:
        """The dedup part plan against the folder's newest ``.ckpt`` (plain tuples), or None: everything is sent."""
        try:
            plan, self.records = plan_shared(self.storage, self.fmt, fixed or [], self.hashed, self.fmt.layout.size)
        except FastCkptError as e:  # only bytes are lost: the file is sent whole
            log.warning("fastckpt: no dedup plan for %s (%s): it is sent whole", self.fmt.path, e)
            return None
        return plan

    def _finish(self, merged: list[Any], failed: str | None, measured: bool) -> str | None:
        """Complete the upload (the commit point) with every rank's parts, or abort it; then the marker goes."""
        if failed is None:
            try:
                done = [d for part in merged for d in part]
                if measured:  # an older file's record: gone before this file takes the name (a crash: no record)
                    self.storage.delete(sidecar_path(self.fmt.path))
                if self.dedup:  # likewise the older file's content records (a crash: the next file is sent whole)
                    drop_records(self.storage, self.fmt.path)
                self.parts.complete(self.fmt.path, str(self.upload_id), done)  # <- the commit point
                self.crc32c = whole_crc32c(done)
            except BaseException as e:  # noqa: BLE001 - broadcast as the verdict
                failed = f"rank 0 commit: {e}"
            else:
                self._unmark()
                if measured:
                    self._write_sidecar()
                if self.records:
                    save_records(self.storage, self.fmt.path, self.fmt.layout.size, self.records)
                return None
        if self.upload_id is not None:
            self._abort()
        return failed

    def _write_sidecar(self) -> None:
        tensors = self.tensors
        doc = summarize(tensors, len(tensors) == len(set(self.keys)))
        try:
            self.storage.write_atomic(sidecar_path(self.fmt.path),
                                      sidecar_bytes(doc, self.step, self.fmt.layout.size, self.digest))
        except FastCkptError as e:  # the file is committed; its health stays unknown, never wrong
            log.warning("fastckpt: the health record of %s was not written: %s", self.fmt.path, e)

    # ---- every rank ------------------------------------------------------------------------------------------

    def _exchange(self, frags: list[Fragment], views: dict[int, memoryview]) -> dict[tuple[int, int], bytes]:
        """Send the fragments this rank holds to the parts' owners, receive those its parts lack (gloo, point to
        point, all posted before any is waited for: no order between pairs to deadlock on)."""
        group, me = self.coord.group, self.coord.rank
        works, inbox = [], {}
        try:
            for tag, f in enumerate(frags):
                if f.src == me:
                    data = torch.frombuffer(bytearray(views[f.record][f.lo:f.hi]), dtype=torch.uint8)
                    works.append(dist.isend(data, dist.get_global_rank(group, f.dst), group=group, tag=tag))
                elif f.dst == me:
                    inbox[(f.part, f.record)] = buf = torch.empty(f.hi - f.lo, dtype=torch.uint8)
                    works.append(dist.irecv(buf, dist.get_global_rank(group, f.src), group=group, tag=tag))
            for w in works:
                w.wait()
        except Exception as e:
            raise _LostRanks(f"moving record bytes between the ranks failed (a rank died?): {e}") from e
        return {k: v.numpy().tobytes() for k, v in inbox.items()}

    def _upload(self, plan: list[Part], fixed: list[tuple[int, bytes]], records: list[tuple[int, int, int]],
                views: dict[int, memoryview], received: dict[tuple[int, int], bytes]) -> list[Any]:
        """Upload this rank's parts, each built from the fixed bytes, its own records and what it received."""
        me = self.coord.rank
        pieces: list[tuple[int, int, Any]] = [(off, off + len(b), b) for off, b in fixed]
        pieces += [(off, off + n, i) for i, (off, n, _) in enumerate(records) if n]
        pieces.sort(key=lambda p: p[0])

        def body(p: Part) -> bytes:
            out = []
            for start, end, what in pieces:
                lo, hi = max(start, p.start), min(end, p.end)
                if lo >= hi:
                    continue
                if isinstance(what, bytes):
                    out.append(what[lo - start:hi - start])
                elif records[what][2] == me:
                    out.append(views[what][lo - start:hi - start])
                else:
                    out.append(received[(p.number, what)])
            return b"".join(out)

        mine = [p for p in plan if p.owner == me]
        done, resent = self.parts.upload(self.fmt.path, str(self.upload_id),
                                         [(p.number, lambda p=p: body(p)) for p in mine])
        if resent:
            log.warning("fastckpt: %d part(s) of %s were sent again (damaged in flight)", resent, self.fmt.path)
        self.mine = [p.number for p in mine]
        self.written = sum(d[3] for d in done)
        return done

    def _copy(self, plan: list[Part], copies: dict[int, Copy], fixed: list[tuple[int, bytes]],
              records: list[tuple[int, int, int]], views: dict[int, memoryview],
              local: BaseException | None) -> tuple[list[Part], str | None, list[Any]]:
        """Every rank: the CRC32C of its bytes in each copied part go to rank 0, which copies those parts and checks
        each against the combined CRC32C; returns the parts left to send (the sent ones, the copies that did not
        match), rank 0's verdict so far, and (rank 0) the copied parts."""
        pieces: list[Any] = []
        if local is None:
            try:
                pieces = piece_crcs(plan, copies, records, views, self.coord.rank)
            except BaseException as e:  # noqa: BLE001 - reported to rank 0 below, so no rank hangs
                local = e
        merged, failed = self._guarded(self.coord.gather, pieces, local)
        fell: list[int] | None = None
        done: list[Any] = []
        if self.coord.rank == 0 and failed is None:
            try:
                fell, done = self._copy_parts(plan, copies, fixed, merged)
            except BaseException as e:  # noqa: BLE001 - broadcast as the verdict
                failed = f"rank 0 copying parts: {e}"
        fell, failed = self._guarded(self.coord.share, (fell, failed))
        left = set(fell or [])
        return [p for p in plan if p.number not in copies or p.number in left], failed, done

    def _copy_parts(self, plan: list[Part], copies: dict[int, Copy], fixed: list[tuple[int, bytes]],
                    pieces: list[Any]) -> tuple[list[int], list[Any]]:
        """Rank 0: UploadPartCopy of each copied part; (the numbers of those to send instead, the copied parts)."""
        fell: list[int] = []
        done: list[Any] = []
        for p in plan:
            if p.number not in copies:
                continue
            crc = expected_crc(p, pieces, fixed)
            source, at = copies[p.number]
            etag = None if crc is None else self.parts.copy(self.fmt.path, str(self.upload_id), p.number, source, at,
                                                            p.end - p.start, crc)
            if etag is None:
                fell.append(p.number)
            else:
                done.append((p.number, etag, crc, p.end - p.start))
        self.copied = sum(d[3] for d in done)
        if fell:
            log.info("fastckpt: %d copied part(s) of %s are sent instead", len(fell), self.fmt.path)
        return fell, done

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """A collective of the protocol; one that fails (a rank died) aborts the upload from this rank."""
        try:
            return self._collective(fn, *args)
        except FastCkptError as e:
            self._lost(e)
            raise

    def _lost(self, e: BaseException) -> None:
        """The ranks lost each other: no rank will complete the upload, so this one aborts it (rank 0 may be the
        one that died); the marker goes once it is aborted."""
        if self.upload_id is not None:
            log.warning("fastckpt: aborting the upload of %s: %s", self.fmt.path, e)
            self._abort()

    def _abort(self) -> None:
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is not None and self.parts.abort(self.fmt.path, upload_id):
            try:
                self.storage.delete(self.marker)
            except FastCkptError as e:  # the sweep finds the upload gone and removes it
                log.info("fastckpt: could not remove the marker %s: %s", self.marker, e)
            self.marked = False

    def _unmark(self) -> None:
        self.upload_id = None  # completed: nothing to abort any more
        if self.marked:
            self.marked = False
            try:
                self.storage.delete(self.marker)
            except FastCkptError as e:
                log.info("fastckpt: could not remove the marker %s: %s", self.marker, e)


def shared_write(coord: Coordinator, storage: Any, fmt: TorchFileFormat, uid: str, writers: list[int], name: str,
                 step: int, keys: list[str], grace_s: float | None, dedup: bool = False) -> SharedFileWrite:
    """The commit protocol of one file shared by the ranks: the parts of one S3 object (its unchanged ranges copied
    server-side with ``dedup``), or ranges of one file."""
    if can_share_object(storage):
        return SharedObjectWrite(coord, storage, fmt, uid, writers, name, step, keys, grace_s, dedup)
    return SharedFileWrite(coord, storage, fmt, uid, writers, name)


def whole_crc32c(done: list[Any]) -> int:
    """The whole object's CRC32C from its parts' ((number, ETag, CRC32C, length)): what a framework's manifest records
    (``format/bundle.py``), without reading the object back."""
    crc = 0
    for _, _, part_crc, length in sorted(done):
        crc = combine(crc, part_crc, length)
    return crc


class _LostRanks(StorageError):
    """Point-to-point transfers failed: the ranks lost each other."""
