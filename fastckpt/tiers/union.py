"""``CatalogUnion``: the committed checkpoints of the local root and of the remote tier, seen as one.

A name committed in both is the same checkpoint; the local copy is preferred (nearest first). Without a remote tier
the union is the local catalog. Listing a remote tier that does not answer falls back to the local checkpoints with
a warning, unless there are none: resuming from scratch because the network is down would silently lose the run.

The union also keeps both tiers in step on rank 0: a commit is catalogued and queued for upload, retention never
deletes a checkpoint whose upload is pending, a deletion removes both copies in order with the saves and uploads
submitted before it, and the checkpoints a dead process committed but never uploaded are uploaded again.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from contextlib import contextmanager
from concurrent.futures import wait as wait_futures
from typing import Callable, Iterator

from ..config import RetentionOptions
from ..engine.futures import remaining, resolved, settle
from ..engine.handle import SaveHandle
from ..engine.priority import ThreadPriorities
from ..errors import CheckpointNotFoundError, FastCkptError, IntegrityError, StorageError
from ..format.layout import CheckpointInfo
from ..storage.protocol import Storage
from .catalog import Catalog
from .remote import RemoteTier, Upload

RunInOrder = Callable[[Callable[[], None]], Future]  # the committer's queue: after every save submitted before

__all__ = ["CatalogUnion"]

log = logging.getLogger("fastckpt")


class CatalogUnion:
    """Lists and locates committed checkpoints across the local and the remote catalog."""

    def __init__(self, local: Catalog, remote: Catalog | None, retention: RetentionOptions, *,
                 grace_s: float | None = None) -> None:
        """``grace_s`` (``orphan_grace_s``): how old the marker of a multipart upload to the remote tier that a dead
        process left must be before the uploads sweep it (``RemoteTier``); None never sweeps."""
        self.local, self.remote, self.retention, self.grace_s = local, remote, retention, grace_s
        self.uploader: RemoteTier | None = None  # rank 0 uploads for everyone (start_uploads)
        self._pending: Callable[[], list[str]] = list
        self._run_in_order: RunInOrder | None = None

    def start_uploads(self, *, workers: int, keep_last: int | None, priorities: ThreadPriorities, dedup: bool,
                      run_in_order: RunInOrder, pending: Callable[[], list[str]],
                      on_failed: Callable[[SaveHandle | None, FastCkptError], None]) -> RemoteTier:
        """Called once on rank 0 with a remote tier: start its upload threads. ``pending`` names the saves not yet
        committed; ``on_failed`` gets each upload failure (with the save's handle, None for ``upload(name)``)."""
        assert self.remote is not None

        def failed(up: Upload, err: FastCkptError) -> None:
            log.error("fastckpt: %s", err)
            on_failed(up.handle, err)

        self._pending, self._run_in_order = pending, run_in_order
        self.uploader = RemoteTier(self.local.storage, self.remote.storage, self.remote, workers=workers,
                                   keep_last=keep_last, priorities=priorities, on_uploaded=self._uploaded,
                                   on_failed=failed, dedup=dedup, grace_s=self.grace_s)
        return self.uploader

    def _uploaded(self, up: Upload, info: CheckpointInfo) -> None:
        if self._run_in_order is not None and self.retention.keep_last is not None:
            # local copies kept only because their upload was pending may go now (on the committer,
            # in order with saves and deletions)
            self._run_in_order(lambda: self.retain(set(self._pending())))

    def committed(self, info: CheckpointInfo, handle: SaveHandle) -> None:
        """Called on the committer once ``handle``'s save is committed, before it leaves the pending saves (so
        retention never sees it unprotected): catalogue it and queue its upload."""
        self.local.committed(info)
        if self.uploader is not None:
            self.uploader.submit(info.name, info.path, handle.expect_upload(), handle)

    def retain(self, pending: set[str]) -> None:
        """Apply local retention; never to the ``pending`` saves nor to checkpoints still being uploaded."""
        if self.uploader is not None:
            pending = pending | self.uploader.pending_names()
        self.local.retain(self.retention, pending)

    def wait_uploads(self, deadline: float | None, run_in_order: Callable[[Callable[[], None]], Future | None]
                     ) -> list[str]:
        """Called by ``Checkpointer.wait``: block (until the ``time.monotonic()`` ``deadline``) for the queued
        uploads and, with local retention, for the retention they unblocked on the committer; returns what is
        still pending."""
        uploader = self.uploader
        if uploader is None:
            return []
        wait_futures(uploader.pending_futures(), remaining(deadline))
        barrier = None
        if self.retention.keep_last is not None:
            # local retention that finished uploads queued on the committer has run once this returns
            barrier = run_in_order(lambda: None)
            if barrier is not None:
                wait_futures([barrier], remaining(deadline))
        return self.uploads_left() + (["local retention"] if barrier is not None and not barrier.done() else [])

    def uploads_left(self) -> list[str]:
        """The uploads not finished, as ``wait``/``close`` name them."""
        uploader = self.uploader
        if uploader is not None and any(not f.done() for f in uploader.pending_futures()):
            return [f"upload {n!r}" for n in sorted(uploader.pending_names())]
        return []

    def delete(self, name: str, run_in_order: RunInOrder) -> Future:
        """Delete ``name`` (both copies, with a remote tier) after every save and upload submitted before."""
        uploader = self.uploader
        if uploader is None:
            return run_in_order(lambda: self.local.delete(name))
        both: Future = Future()

        def local() -> None:  # on the committer, behind the saves; then on the upload thread, behind the uploads
            try:
                self.local.delete(name)
                failed = None
            except BaseException as e:  # noqa: BLE001 - the remote copy is still deleted, then this is raised
                failed = e

            def remote() -> None:
                uploader.catalog.delete(name)
                if failed is not None:
                    raise failed

            uploader.run_in_order(remote, both)

        run_in_order(local)
        return both

    def upload(self, name: str, run_in_order: RunInOrder) -> Future:
        """Upload the locally committed ``name`` (again) after every save submitted before; the future resolves to
        the remote ``CheckpointInfo`` and carries its error. Resolved at once to None where rank 0 uploads."""
        uploader = self.uploader
        if uploader is None:
            return resolved(None)  # rank 0 uploads for everyone
        done: Future = Future()

        def submit() -> None:
            info = self.local.info(name)
            if info is None:
                raise CheckpointNotFoundError(f"no committed checkpoint {name!r} under {self.local.storage.url} "
                                              "to upload")
            uploader.submit(name, info.path, done)

        queued = run_in_order(submit)
        queued.add_done_callback(lambda f: f.exception() is not None and settle(done, exc=f.exception()))
        return done

    def resume_uploads(self, skip: set[str], new_handle: Callable[[CheckpointInfo], SaveHandle]) -> list[SaveHandle]:
        """Upload the local checkpoints a previous process committed but never uploaded (it died, or its uploads
        failed): those newer than the newest remote one, minus ``skip``. Older local ones missing remotely were
        pruned there by ``remote.keep_last``, or predate the tier; ``upload(name)`` sends them."""
        assert self.uploader is not None
        handles = []
        for info in self.not_uploaded(skip) or []:
            log.warning("fastckpt: checkpoint %r (step %d) is committed under %s but not on the remote tier; "
                        "uploading it now", info.name, info.step, self.local.storage.url)
            handle = new_handle(info)
            handle.mark_staged()
            handle.set_committed(info)  # committed locally long ago: only the upload is pending
            self.uploader.submit(info.name, info.path, handle.expect_upload(), handle)
            handles.append(handle)
        return handles

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints of both tiers (by name, the local copy first), oldest step first."""
        return self.listing()[0]

    def listing(self) -> tuple[list[CheckpointInfo], set[str]]:
        """The union of both tiers, and the names committed locally."""
        local = self.local.list()
        names = {i.name for i in local}
        if self.remote is None:
            return local, names
        try:
            remote = self.remote.list()
        except FastCkptError as e:
            url = self.remote.storage.url
            if not local:  # resuming from scratch because the remote is down would silently lose the run
                raise StorageError(f"cannot list the remote tier at {url} and {self.local.storage.url} holds no "
                                   f"checkpoint: {e}. Check remote.url, remote.storage_options and the network") from e
            log.warning("fastckpt: cannot list the remote tier at %s, using the local checkpoints only: %s", url, e)
            return local, names
        union = {i.name: i for i in remote}
        union.update((i.name, i) for i in local)
        return sorted(union.values(), key=lambda i: (i.step, i.name)), names

    def newest_healthy(self, step: int | None, name: str | None) -> str:
        """The name of the newest checkpoint whose health record shows no NaN or Inf (at ``step`` when given;
        ``name`` itself when given and healthy). Raises ``CheckpointNotFoundError`` saying what was found."""
        infos = [i for i in self.list() if (step is None or i.step == step) and (name is None or i.name == name)]
        good = [i for i in infos if i.healthy]
        if good:
            return good[-1].name
        sick = [i.name for i in infos if i.healthy is False]
        raise CheckpointNotFoundError(
            f"no healthy committed checkpoint{'' if step is None else f' at step {step}'}"
            f"{'' if name is None else f' named {name!r}'} under {self.local.storage.url}: {len(infos)} found, "
            f"{len(sick)} with NaN/Inf values ({', '.join(sick[-3:]) or 'none'}), the others not measured "
            "(saved with health.enabled: false or by an older fastckpt) or with a record that contradicts itself "
            "(incomplete, or its tensor rows count NaN/Inf). Load one by name or step without "
            "healthy=True, or resume from scratch")

    def exists(self, name: str) -> bool:
        """Whether ``name`` is committed in either tier."""
        if self.local.info(name) is not None:
            return True
        return self.remote is not None and self.remote.info(name) is not None

    def locate(self, step: int | None, name: str | None, healthy: bool = False) -> tuple[Storage, str]:
        """The storage holding the checkpoint to read, and its name: ``name`` if given, else the newest at
        ``step`` (the newest of all when None); ``healthy``: the newest of those without NaN/Inf
        (``newest_healthy``). Raises ``CheckpointNotFoundError`` naming both tiers."""
        if healthy:
            step, name = None, self.newest_healthy(step, name)
        remote = self.remote
        if remote is None:
            return self.local.storage, name if name is not None else self.local.resolve(step)
        here = self.local.storage.url
        if name is not None:
            if self.local.info(name) is not None:
                return self.local.storage, name
            if remote.info(name) is not None:
                return remote.storage, name
            raise CheckpointNotFoundError(f"no committed checkpoint {name!r} under {here} or on the "
                                          f"remote tier at {remote.storage.url}; list them with Checkpointer.list()")
        infos, local = self.listing()
        if step is not None:
            infos = [i for i in infos if i.step == step]
        if not infos:
            what = f"at step {step}" if step is not None else "at all"
            raise CheckpointNotFoundError(f"no committed checkpoint {what} under {here} or on the "
                                          f"remote tier at {remote.storage.url}")
        target = infos[-1].name
        return (self.local.storage if target in local else remote.storage), target

    @contextmanager
    def explaining(self, storage: Storage, dirpath: str, root: str) -> Iterator[None]:
        """Around a load from ``dirpath``: an ``IntegrityError`` (a file missing, short or failing its checksum)
        is raised again told so that the user can act (``explain``). Its subclasses (``UnsafeCheckpointError``: a
        class not allowed, no damage) pass unchanged."""
        try:
            yield
        except IntegrityError as e:
            better = self.explain(storage, dirpath, e, root) if type(e) is IntegrityError else None
            if better is None:
                raise
            raise better from e

    def explain(self, storage: Storage, dirpath: str, err: IntegrityError, root: str) -> IntegrityError | None:
        """``err`` of a load from ``dirpath`` with what the checkpoint lacks (a folder deleted part way keeps its
        manifest) and which older checkpoint is whole, to load instead; None when the root cannot be listed."""
        name = dirpath.rstrip("/").rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1]
        catalog = self.remote if self.remote is not None and storage is self.remote.storage else self.local
        try:
            lacks = catalog.damage(name)
            older = self.older_whole(name)
        except FastCkptError:
            return None  # the root cannot be listed now: the reader's own error says enough
        what = f"{err}" + (f" ({name}: {lacks})" if lacks else "")
        if older is None:
            return IntegrityError(f"{what}; no older checkpoint under {root} has all its files. `fastckpt verify` "
                                  "names every bad file")
        return IntegrityError(f"{what}. The newest older checkpoint with all its files is {older.name} (step "
                              f"{older.step}): load it with load(step={older.step}), and remove the damaged one "
                              f"(Checkpointer.delete({name!r})) so that the latest loads again")

    def older_whole(self, name: str) -> CheckpointInfo | None:
        """The newest checkpoint listed before ``name`` (older step) whose files are all there, in either tier."""
        infos, local = self.listing()
        names = [i.name for i in infos]
        before = infos[: names.index(name)] if name in names else infos
        for info in reversed(before):
            catalog = self.local if info.name in local or self.remote is None else self.remote
            if catalog.damage(info.name) is None:
                return info
        return None

    def not_uploaded(self, skip: set[str]) -> list[CheckpointInfo] | None:
        """The local checkpoints newer than the newest remote one (a previous process committed them but never
        uploaded them), minus ``skip``; None when the remote tier cannot be listed (logged)."""
        assert self.remote is not None
        try:
            remote = self.remote.list()
        except FastCkptError as e:
            log.warning("fastckpt: cannot list the remote tier at %s, so local checkpoints that were never "
                        "uploaded are not resumed now (Checkpointer.upload(name) sends one): %s",
                        self.remote.storage.url, e)
            return None
        newest = max((i.step for i in remote), default=None)
        return [info for info in self.local.list()
                if not (newest is not None and info.step <= newest) and info.name not in skip]
