"""``fastckpt gc`` and ``fastckpt persist-pending``: housekeeping of a core root by hand.

``gc`` applies the retention rules a ``Checkpointer`` applies after each commit
(``Catalog.doomed``), then removes the folders of saves that died uncommitted (``fastckpt.tiers.gc``),
holding the root lock as a writer would. ``persist-pending`` constructs a ``Checkpointer`` with the
shared-memory tier on the root: its constructor commits what a crashed process left staged
(``fastckpt.tiers.recovery``); the command reports each checkpoint it committed.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from ..format.healthrecord import delete_with_record
from ..errors import CheckpointNotFoundError, FastCkptError
from .options import CliOptions, checkpoint_config
from .text import clean

__all__ = ["run_gc", "run_persist_pending"]


def _locked(root: str, opts: CliOptions, work: Callable[[Any], list[str]], dry_run: bool = False) -> list[str]:
    """``work(storage)`` while holding ``root``'s lock (refused while a live Checkpointer writes there). A
    ``dry_run`` neither creates nor takes the lock: it changes nothing on disk (the lock is a file, and a folder
    that is no root, a home directory, must not get one), and even a shared peek at it would make a writer
    starting at that moment fail as if the root were in use. It removes nothing, so nothing needs excluding."""
    from .. import open_storage
    from ..tiers.lock import RootLock

    storage = open_storage(root, opts.storage_options)
    lock = RootLock.for_root(storage.url)
    if lock is not None:
        if not os.path.isdir(lock.root):
            raise CheckpointNotFoundError(f"no checkpoint root at {lock.root}; check the path")
        if dry_run:
            lock = None
        else:
            lock.acquire()
    elif not storage.listdir(storage.url):
        raise CheckpointNotFoundError(f"nothing under {storage.url}; check the path and --storage-option")
    try:
        return work(storage)
    finally:
        if lock is not None:
            lock.release()


def run_gc(args: argparse.Namespace, opts: CliOptions) -> int:
    verb = "would remove" if args.dry_run else "removed"
    failed: list[str] = []
    lines = _locked(args.root, opts, lambda storage: [f"{verb}  {line}" for line in _collect(storage, args, opts,
                                                                                              failed)],
                    dry_run=args.dry_run)
    for line in lines:
        print(clean(line))
    for line in failed:
        print(f"fastckpt: error: {clean(line)}", file=sys.stderr)
    if not lines and not failed:
        print(f"nothing to remove under {clean(args.root)}", file=sys.stderr)
    return 1 if failed else 0


def _collect(storage: Any, args: argparse.Namespace, opts: CliOptions, failed: list[str]) -> list[str]:
    """What gc removes (or would): checkpoints retention does not keep, then what dead saves left that fastckpt
    can prove it wrote (``fastckpt.tiers.gc``). Only what is gone is reported; what could not be removed goes to
    ``failed``. Files fastckpt cannot prove its own (a torn or foreign ``.ckpt``, a symlink) are never removed."""
    from ..tiers.catalog import Catalog, doomed
    from .. import RetentionOptions
    from ..tiers.gc import collect, collect_temp_files
    from .listing import list_root

    rules = RetentionOptions(keep_last=args.keep_last, keep_every_n_steps=args.keep_every)
    rows = [r for r in list_root(args.root, opts) if r.layout != "core"]
    catalog = Catalog(storage)
    lines = []
    if not rows:  # a core root: the Catalog's own rules, then fastckpt.tiers.gc's proofs of death and authorship
        for info in catalog.doomed(rules, set()):
            if _remove(failed, info.path, args.dry_run, lambda: catalog.delete(info.name)):
                lines.append(f"{info.path}  (step {info.step}, retention)")
    else:
        # A Lightning dirpath or an Accelerate checkpoints/ folder: the same rules over its rows; last.ckpt is a
        # second copy of a step that stays. Only what a save writes is counted (a 0.1 pointer names data folders,
        # a DCP folder is stock Lightning's, a symlink is somebody else's): left alone.
        kept = [r for r in rows if r.status == "committed" and r.step is not None and r.name != "last.ckpt"
                and r.layout in ("lightning", "lightning-sharded", "accelerate") and not _is_link(storage, r.path)]
        for row in doomed(kept, rules, set()):
            if row.layout == "lightning-sharded":
                work: Callable[[], None] = lambda row=row: catalog.delete(row.name)  # type: ignore[misc]
            elif row.layout == "accelerate":
                work = lambda row=row: storage.delete_tree(row.path)  # type: ignore[misc]
            else:
                work = lambda row=row: _delete_file(storage, row.path)  # type: ignore[misc]
            if _remove(failed, row.path, args.dry_run, work):
                lines.append(f"{row.path}  (step {row.step}, retention)")
    if rows and not any(r.layout.startswith("lightning") for r in rows):
        return lines  # an Accelerate folder: its saves are folders, never temporary files
    lines += [f"{path}  (uncommitted)" for path in collect(storage, args.grace_s, dry_run=args.dry_run)]
    lines += [f"{path}  (temporary file of a dead save)"
              for path in collect_temp_files(storage, args.grace_s, dry_run=args.dry_run)]
    return lines


def _remove(failed: list[str], path: str, dry_run: bool, work: Callable[[], None]) -> bool:
    """Run ``work`` (unless ``dry_run``); whether ``path`` is gone (or would be). Failures go to ``failed``."""
    if dry_run:
        return True
    try:
        work()
    except (FastCkptError, OSError) as e:
        failed.append(f"{path} was not removed: {' '.join(str(e).split())}")
        return False
    return True


def _is_link(storage: Any, path: str) -> bool:
    from .. import LocalStorage

    return isinstance(storage, LocalStorage) and os.path.islink(path)


def _delete_file(storage: Any, path: str) -> None:
    """Delete a checkpoint file retention dropped: a regular file only, never through a symlink."""
    from ..errors import StorageError

    is_plain = getattr(storage, "is_plain_file", None)
    if is_plain is not None and not is_plain(path):
        raise StorageError(f"{path} is not a regular file (a symlink, a folder or a FIFO): not deleted")
    delete_with_record(storage, path)


def run_persist_pending(args: argparse.Namespace, opts: CliOptions) -> int:
    from .. import Checkpointer

    staging: dict[str, Any] = {"shm": True}
    if args.shm_dir is not None:
        staging["shm_dir"] = args.shm_dir
    failed = 0
    with Checkpointer(checkpoint_config(opts, args.root, staging=staging)) as ckpt:
        for handle in ckpt.recovered:
            try:
                info = handle.wait()
                print(clean(f"committed  {info.path if info else handle.path}  (step {handle.step})"))
            except FastCkptError as e:
                failed += 1
                print(clean(f"fastckpt: error: {handle.name} (step {handle.step}) was not committed: "
                            f"{' '.join(str(e).split())}"), file=sys.stderr)
        if not ckpt.recovered:
            print(f"nothing staged in shared memory for {clean(args.root)}", file=sys.stderr)
    return 1 if failed else 0
