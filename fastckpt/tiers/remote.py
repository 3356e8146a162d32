"""The remote tier: committed local checkpoints are copied to a remote fsspec URL in the background.

Checkpoints commit to the fast local ``root`` first. Right after a local commit the
committer hands the checkpoint to ``RemoteTier.submit``, which reads its manifest and
maps (mmap, no readahead yet) every file the manifest lists. From then on the upload
holds the bytes it will send: a later save under the same name, which replaces and
deletes those files, cannot pull them from under it.

The ``fastckpt-upload-<n>`` thread takes uploads in commit order. Each file is streamed
from its mapping to the remote ``Storage.write_file`` on the ``fastckpt-up-<n>`` workers
(a big file on S3 is one multipart upload whose parts go up concurrently); the sizes
come from the manifest, nothing is read back. On S3 every PUT and part carries its CRC32C,
and what the store answers is checked against the manifest (``remotesums.py``, ``checksums``).
With ``remote.dedup`` on S3, the ranges of a shard that the newest remote checkpoint already holds are copied
server-side instead of sent (``dedup.py``). Then the same manifest bytes are written last with ``write_atomic``:
the remote commit, so the remote copy exists only once it is complete. A failed upload removes the files it wrote
(best effort) and never writes the manifest; the local checkpoint stays committed. Remote retention (``remote.keep_last``)
runs after each upload. Remote deletions travel through the same queue, so they run
behind the uploads submitted before them. A multipart upload (a big file, a planned one) is marked under
``<remote>/.fastckpt/uploads/`` while in flight (``storage/fsspec.py``); the first job of the upload thread sweeps the
ones a killed process left, once their marker is ``orphan_grace_s`` old (``gc.collect_uploads``).

Threads: ``fastckpt-upload-<n>`` stops on a ``None`` sentinel; ``fastckpt-up-<n>`` is an
executor; both stop in ``close``.
"""
from __future__ import annotations

import json

import collections
import itertools
import logging
import mmap
import queue
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Callable

from .catalog import Catalog
from .dedup import plan_for, previous_records, records_of
from .gc import collect_uploads
from .remotesums import ChecksumStats
from ..config import RetentionOptions
from ..errors import CheckpointTimeoutError, FastCkptError, IntegrityError, StorageError
from ..format.layout import MANIFEST, parse_manifest
from ..engine.futures import copy_outcome, settle, succeeded
from ..format.health import healthy_of
from ..format.layout import CheckpointInfo
from ..engine.handle import SaveHandle
from ..format.paths import confine
from ..engine.priority import ThreadPriorities
from ..engine.threadsignals import quiet
from ..storage.fsspec import FsspecStorage
from ..storage.partplan import Record, SourceRecord
from ..storage.protocol import Storage

__all__ = ["RemoteTier", "Upload"]

log = logging.getLogger("fastckpt")
_ids = itertools.count(1)


@dataclass(eq=False)
class Upload:
    """One committed local checkpoint on its way to the remote tier."""

    name: str
    src: str  # the local checkpoint directory
    future: Future
    handle: SaveHandle | None = None  # None for Checkpointer.upload(name)
    step: int = -1
    manifest: bytes = b""
    files: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (size, crc32c), from the manifest
    maps: dict[str, tuple[Any, memoryview]] = field(default_factory=dict)  # pre-mapped sources
    records: dict[str, list[Record]] = field(default_factory=dict)  # content records by file (dedup.py)
    reported: bool = False

    def release(self) -> None:
        maps, self.maps = self.maps, {}
        for mm, view in maps.values():
            try:
                view.release()
                if mm is not None:
                    mm.close()
            except BufferError:  # a slice is still referenced (a traceback); the GC unmaps it later
                pass


class RemoteTier:
    """Owns the upload thread and its workers for one ``Checkpointer`` (on rank 0)."""

    def __init__(self, local: Storage, remote: Storage, catalog: Catalog, *, workers: int, keep_last: int | None,
                 priorities: ThreadPriorities | None = None, on_uploaded: Callable[[Upload, CheckpointInfo], None],
                 on_failed: Callable[[Upload, FastCkptError], None], dedup: bool = True,
                 grace_s: float | None = None) -> None:
        self.local = local
        self.remote = remote
        self.catalog = catalog
        self._keep = RetentionOptions(keep_last=keep_last)
        self._on_uploaded = on_uploaded
        self._on_failed = on_failed
        self._priorities = priorities or ThreadPriorities("idle")
        self._lock = threading.Lock()
        self._pending: dict[Upload, None] = {}  # queued or running, in submission order
        self._names: collections.Counter[str] = collections.Counter()
        self._newest: dict[str, Upload] = {}
        self._abort: str | None = None
        self._orphans: dict[str, set[str]] = {}  # remote dir -> files a failed upload could not remove
        self.checksums = ChecksumStats()  # what the store verified of the uploads (remotesums.py)
        self._dedup = dedup and getattr(remote, "copies_ranges", False)
        n = next(_ids)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"fastckpt-up-{n}",
                                        initializer=lambda: (quiet(), self._priorities.enlist()))
        self._q: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"fastckpt-upload-{n}", daemon=True)
        self._thread.start()
        self._closed = False
        # first on the upload thread: abort the multipart uploads to the remote that a killed process left
        self.run_in_order(lambda: collect_uploads(remote, grace_s))

    # ---- called by the Checkpointer -------------------------------------------------

    def submit(self, name: str, src: str, future: Future, handle: SaveHandle | None = None) -> None:
        """Queue the locally committed checkpoint at ``src``; called on the committer, right after the commit."""
        up = Upload(name, src, future, handle)
        try:
            self._prepare(up)
        except BaseException as e:  # noqa: BLE001 - reported like any upload failure
            up.release()
            self._report(up, self._error(up, e))
            return
        with self._lock:
            self._pending[up] = None
            self._names[name] += 1
            self._newest[name] = up
        self._q.put(up)

    def run_in_order(self, fn: Callable[[], Any], fut: Future | None = None) -> Future:
        """Run ``fn`` on the upload thread after every upload submitted so far (remote deletions)."""
        fut = fut if fut is not None else Future()
        self._q.put((fn, fut))
        return fut

    def pending_names(self) -> set[str]:
        """Names with an upload queued or running: local retention must keep them."""
        with self._lock:
            return set(self._names)

    def pending_futures(self) -> list[Future]:
        with self._lock:
            return [up.future for up in self._pending]

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued uploads (at most ``timeout`` seconds), then stop the threads; idempotent.

        Uploads still queued or running when the timeout expires fail with a ``StorageError``
        (reported like any upload failure); one already running may still finish in the background.
        """
        if self._closed:
            return
        self._closed = True
        wait_futures(self.pending_futures(), timeout)
        with self._lock:
            left = list(self._pending)
            if left:
                self._abort = f"Checkpointer.close(timeout={timeout}) expired before the upload finished"
        for up in left:
            self._report(up, self._error(up, TimeoutError(self._abort)))
        self._q.put(None)
        self._thread.join(None if not left else 0)
        self._pool.shutdown(wait=not left, cancel_futures=True)
        if left:
            log.warning("fastckpt: %d upload(s) to %s did not finish before close(); not waiting for them",
                        len(left), self.remote.url)

    # ---- upload thread ----------------------------------------------------------------

    def _loop(self) -> None:
        quiet()  # signals go to the training thread (engine/threadsignals.py)
        self._priorities.enlist()
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, tuple):
                fn, fut = item
                try:
                    settle(fut, result=fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller's future
                    settle(fut, exc=e)
                continue
            self._run(item)

    def _run(self, up: Upload) -> None:
        with self._lock:
            newer = self._newest.get(up.name)
            abort = self._abort
        try:
            if abort is not None:
                return  # close() already failed it
            if newer is not up and newer is not None:
                # A later save under the same name is queued: only the newest bytes go up.
                newer.future.add_done_callback(lambda f: copy_outcome(f, up.future))
                return
            try:
                info = self._upload(up)
            except BaseException as e:  # noqa: BLE001 - every failure becomes the upload's error
                self._done(up)
                self._report(up, self._error(up, e))
                return
            self._done(up)
            self._on_uploaded(up, info)
            settle(up.future, result=info)
        finally:
            self._done(up)
            up.release()

    def _done(self, up: Upload) -> None:
        with self._lock:
            if up not in self._pending:
                return
            del self._pending[up]
            self._names[up.name] -= 1
            if not self._names[up.name]:
                del self._names[up.name]
            if self._newest.get(up.name) is up:
                del self._newest[up.name]

    def _report(self, up: Upload, err: FastCkptError) -> None:
        self._done(up)
        with self._lock:
            if up.reported or up.future.done():
                return  # close() and the upload thread may both get here
            up.reported = True
        self._on_failed(up, err)
        settle(up.future, exc=err)

    # ---- the work -----------------------------------------------------------------------

    def _prepare(self, up: Upload) -> None:
        """Read the local manifest and map every file it lists (on the committer, before anything can replace them)."""
        st = self.local
        mpath = st.join(up.src, MANIFEST)
        up.manifest = st.read_bytes(mpath)
        doc = parse_manifest(up.manifest, mpath)
        up.step = int(doc["step"])
        up.files = {name: (int(rec["size"]), int(rec["crc32c"])) for name, rec in doc["files"].items()}
        up.records = records_of(doc) if self._dedup else {}
        mapper = getattr(st, "map_file", None)
        if mapper is None:
            return  # a root that cannot be mapped (not a local filesystem): read at upload time
        for name, (size, _) in up.files.items():
            if size == 0:
                up.maps[name] = (None, memoryview(b""))
            else:
                up.maps[name] = mapper(self._source(up, name), size, readahead=False)

    def _source(self, up: Upload, name: str) -> str:
        """The local path of the listed file ``name`` (a plain name: ``parse_manifest`` checked it). A symlink
        planted in the checkpoint that leads outside is refused: it would upload that file to the bucket."""
        return confine(up.src, self.local.join(up.src, name), f"{up.src}: file {name!r} to upload")

    def _upload(self, up: Upload) -> CheckpointInfo:
        rs = self.remote
        dst = rs.join(rs.url, up.name)
        self._clean_orphans(dst, set(up.files))
        old = self._remote_files(dst)
        # A file the committed remote copy already holds (same name, size and CRC: the names carry the save's
        # uid) is not sent again, so retrying upload(name) of an uploaded checkpoint never rewrites its files.
        send = [name for name, rec in up.files.items() if old.get(name) != rec]
        t0 = time.perf_counter()
        prev = previous_records(rs, self.catalog) if up.records else []
        futures = [self._pool.submit(self._put, up, name, dst, prev) for name in send]
        wait_futures(futures, return_when=FIRST_EXCEPTION)
        if self._abort is not None or not all(succeeded(f) for f in futures):
            for f in futures:
                f.cancel()  # the remote is probably gone: do not start the rest
            wait_futures(futures)
            self._discard(dst, [n for n in send if n not in old])
            errors = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception()]
            raise errors[0] if errors else StorageError(self._abort or "upload cancelled")  # type: ignore[misc]
        rs.write_atomic(rs.join(dst, MANIFEST), up.manifest)  # <- the remote commit
        for name in set(old) - set(up.files):  # the remote copy this one replaced
            try:
                rs.delete(rs.join(dst, name))
            except FastCkptError as e:
                log.warning("fastckpt: could not remove replaced remote file %s: %s", rs.join(dst, name), e)
        nbytes = sum(size for size, _ in up.files.values())
        # the health verdict travels in the manifest: the same as the local copy's, and as a later list() reads it
        info = CheckpointInfo(up.name, up.step, dst, nbytes, healthy=healthy_of(json.loads(up.manifest)))
        self.catalog.committed(info)
        log.info("fastckpt: uploaded %s (%.1f MB) to %s in %.2fs", up.name, nbytes / 1e6, dst,
                 time.perf_counter() - t0)
        if self._keep.keep_last is not None:
            try:
                self.catalog.retain(self._keep, self.pending_names() - {up.name})
            except Exception as e:  # noqa: BLE001 - the upload itself committed; retention tries again next time
                log.warning("fastckpt: remote retention under %s failed: %s", rs.url, e)
        return info

    def _put(self, up: Upload, name: str, dst: str, prev: list[SourceRecord]) -> None:
        size = up.files[name][0]
        mapped = up.maps.get(name)
        if mapped is not None:
            view = mapped[1]
            if hasattr(mmap, "MADV_SEQUENTIAL") and mapped[0] is not None:
                mapped[0].madvise(mmap.MADV_SEQUENTIAL)  # aggressive readahead; pages may go once sent
        else:
            view = memoryview(self.local.read_bytes(self._source(up, name)))
            if len(view) != size:
                raise IntegrityError(f"{self.local.join(up.src, name)} has {len(view)} bytes, its manifest says {size}")
        path = self.remote.join(dst, name)
        plan = plan_for(size, up.records.get(name), prev)
        if plan is not None and isinstance(self.remote, FsspecStorage):  # ranges the previous checkpoint holds
            out = self.remote.write_planned(path, view, plan)
            self.checksums.dedup.planned(out)
            self.checksums.record(path, size, up.files[name][1], out.checksum)
            return
        self.checksums.dedup.whole(size)
        if not isinstance(self.remote, FsspecStorage):  # a wrapper's write_file may add to it: call that
            self.remote.write_file(path, [view])
            return
        # the store checks the bytes against the manifest's CRC32C (one PUT) or each part's (multipart)
        sent = self.remote.write_checked(path, [view], up.files[name][1])
        self.checksums.record(path, size, up.files[name][1], sent)

    def _remote_files(self, dst: str) -> dict[str, tuple[int, int]]:
        """Files (size, crc32c) of the remote copy already committed under this name (a re-save replaces it)."""
        mpath = self.remote.join(dst, MANIFEST)
        try:
            files = parse_manifest(self.remote.read_bytes(mpath), mpath)["files"]
            return {name: (int(rec["size"]), int(rec["crc32c"])) for name, rec in files.items()}
        except (FileNotFoundError, IntegrityError, KeyError, TypeError, ValueError, AttributeError):
            return {}

    def _discard(self, dst: str, names: list[str]) -> None:
        """Best effort: remove what a failed upload may have written (never a committed copy's files).

        The remote is likely what failed: stop at the first error and remember the rest, which the
        next upload tries again.
        """
        rs = self.remote
        left = set(names)
        try:
            for name in names:
                rs.delete(rs.join(dst, name))
                left.discard(name)
            if not rs.listdir(dst):
                rs.delete_tree(dst)
        except Exception as e:  # noqa: BLE001 - see above
            log.warning("fastckpt: could not remove the partial remote files of %s (retried after the next "
                        "upload starts): %s", dst, e)
        if left:
            self._orphans.setdefault(dst, set()).update(left)

    def _clean_orphans(self, current: str, writing: set[str]) -> None:
        """Retry removing files left by earlier failed uploads; never files that a committed remote manifest or
        the upload about to start (``writing`` under ``current``) names."""
        for dst in list(self._orphans):
            names = self._orphans.pop(dst)
            try:
                keep = set(self._remote_files(dst)) | (writing if dst == current else set())
            except FastCkptError:  # still unreachable: try again next time
                self._orphans[dst] = names
                continue
            if names - keep:
                self._discard(dst, sorted(names - keep))

    def _error(self, up: Upload, e: BaseException) -> FastCkptError:
        dst = self.remote.join(self.remote.url, up.name)
        # a stalled remote (network.timeout_s, close(timeout)) stays recognisable as a timeout
        cls = CheckpointTimeoutError if isinstance(e, TimeoutError) else StorageError
        err = cls(
            f"uploading checkpoint {up.name!r} to the remote tier at {dst} failed: {e}. The local copy at {up.src} "
            f"is committed and loadable; the remote copy was not committed. Check remote.url, "
            f"remote.storage_options and the network, then retry with Checkpointer.upload({up.name!r}); "
            f"later saves are uploaded as usual")
        err.__cause__ = e
        return err
