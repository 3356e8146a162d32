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
import time
from typing import Any, Callable

from ..errors import CheckpointNotFoundError, FastCkptError
from .options import CliOptions, checkpoint_config

__all__ = ["run_gc", "run_persist_pending"]


def _locked(root: str, opts: CliOptions, work: Callable[[Any], list[str]]) -> list[str]:
    """``work(storage)`` while holding ``root``'s lock (refused while a live Checkpointer writes there)."""
    from .. import open_storage
    from ..tiers.lock import RootLock

    storage = open_storage(root, opts.storage_options)
    lock = RootLock.for_root(storage.url)
    if lock is not None:
        if not os.path.isdir(lock.root):
            raise CheckpointNotFoundError(f"no checkpoint root at {lock.root}; check the path")
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
    lines = _locked(args.root, opts, lambda storage: [f"{verb}  {line}" for line in _collect(storage, args, opts)])
    for line in lines:
        print(line)
    if not lines:
        print(f"nothing to remove under {args.root}", file=sys.stderr)
    return 0


def _collect(storage: Any, args: argparse.Namespace, opts: CliOptions) -> list[str]:
    """What gc removes (or would): checkpoints retention does not keep, then dead uncommitted saves."""
    from ..tiers.catalog import Catalog, doomed
    from .. import RetentionOptions
    from ..tiers.gc import collect, collect_temp_files
    from .listing import list_root

    rules = RetentionOptions(keep_last=args.keep_last, keep_every_n_steps=args.keep_every)
    rows = [r for r in list_root(args.root, opts) if r.layout != "core"]
    if not rows:  # a core root: the Catalog's own rules, then fastckpt.tiers.gc's proof of death
        catalog = Catalog(storage)
        lines = []
        for info in catalog.doomed(rules, set()):
            if not args.dry_run:
                catalog.delete(info.name)
            lines.append(f"{info.path}  (step {info.step}, retention)")
        return lines + [f"{path}  (uncommitted)" for path in collect(storage, args.grace_s, dry_run=args.dry_run)]
    # A Lightning dirpath or an Accelerate checkpoints/ folder: the same rules over its rows; last.ckpt is a
    # second copy of a step that stays. Torn files are garbage once unchanged for the grace period.
    kept = [r for r in rows if r.status == "committed" and r.step is not None and r.name != "last.ckpt"
            and r.layout in ("lightning", "accelerate")]  # a 0.1 pointer names data folders: left alone
    old = time.time() - args.grace_s
    dead = [r for r in rows if r.status == "torn" and r.created is not None and r.created < old]
    lines = []
    for row, why in [(r, f"step {r.step}, retention") for r in doomed(kept, rules, set())] + \
            [(r, "torn") for r in dead]:
        if not args.dry_run:
            (storage.delete_tree if row.layout == "accelerate" else storage.delete)(row.path)
        lines.append(f"{row.path}  ({why})")
    if any(r.layout == "lightning" for r in rows):  # a save killed before its rename left its temporary file
        lines += [f"{path}  (temporary file of a dead save)"
                  for path in collect_temp_files(storage, args.grace_s, dry_run=args.dry_run)]
    return lines


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
                print(f"committed  {info.path if info else handle.path}  (step {handle.step})")
            except FastCkptError as e:
                failed += 1
                print(f"fastckpt: error: {handle.name} (step {handle.step}) was not committed: {e}", file=sys.stderr)
        if not ckpt.recovered:
            print(f"nothing staged in shared memory for {args.root}", file=sys.stderr)
    return 1 if failed else 0
