"""The ``fastckpt`` command: list, verify and inspect checkpoints.

    fastckpt list ROOT                  committed checkpoints under ROOT
    fastckpt verify PATH                check every file's size and CRC32C
    fastckpt inspect PATH               the tensor table of one checkpoint
    fastckpt gc ROOT [--grace-s S] [--dry-run]
                                        remove folders of saves that died uncommitted

ROOT/PATH may be local paths or URLs; ``--storage-options '{"key": ...}'`` passes
fsspec options (JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from .config import CheckpointConfig
from .errors import CheckpointNotFoundError, FastCkptError
from .format import checkpoint_dir
from .loader import CheckpointReader
from .storage import open_storage
from .verify import verify_checkpoint

__all__ = ["main"]


def _reader(path: str, options: dict, verify: bool) -> CheckpointReader:
    storage = open_storage(checkpoint_dir(path), options)
    return CheckpointReader(storage, storage.url, verify=verify)


def _cmd_list(args: argparse.Namespace) -> int:
    from .checkpointer import Checkpointer

    with Checkpointer(CheckpointConfig(root=args.root, storage_options=args.storage_options)) as ckpt:
        infos = ckpt.list()
    for info in infos:
        print(f"{info.step:>10}  {info.nbytes / 1e6:>10.1f} MB  {info.path}")
    if not infos:
        print(f"no committed checkpoints under {args.root}", file=sys.stderr)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    storage = open_storage(checkpoint_dir(args.path), args.storage_options)
    manifest, problems = verify_checkpoint(storage, storage.url)
    for line in problems:  # one line per problem, so that scripts can count and grep them
        print(f"fastckpt: error: {' '.join(line.split())}", file=sys.stderr)
    if problems:
        return 1
    assert manifest is not None
    print(f"OK  {storage.url}: step {manifest['step']}, {len(manifest['files'])} files verified")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    reader = _reader(args.path, args.storage_options, verify=False)
    print(f"{reader.dirpath}  step={reader.step}  name={reader.name}")
    for e in reader.entries:
        print(f"  {e.key:<60} {str(e.dtype).removeprefix('torch.'):<10} {list(e.shape)!s:<20} {e.file}")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from .gc import collect
    from .lock import RootLock

    storage = open_storage(args.root, args.storage_options)
    lock = RootLock.for_root(storage.url)
    if lock is not None:
        if not os.path.isdir(lock.root):
            raise CheckpointNotFoundError(f"no checkpoint root at {lock.root}; check the path")
        lock.acquire()  # refuses while a live Checkpointer writes this root: its folders may be in progress
    try:
        removed = collect(storage, args.grace_s, dry_run=args.dry_run)
    finally:
        if lock is not None:
            lock.release()
    for path in removed:
        print(f"{'would remove' if args.dry_run else 'removed'}  {path}")
    if not removed:
        print(f"no uncommitted folder older than {args.grace_s:.0f} s under {args.root}", file=sys.stderr)
    return 0


def _grace(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"--grace-s must be a number of seconds >= 0, got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastckpt", description="Inspect fastckpt checkpoints.")
    parser.add_argument("--storage-options", type=json.loads, default={}, help="fsspec options as JSON")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="committed checkpoints under ROOT")
    p.add_argument("root")
    p.set_defaults(fn=_cmd_list)
    p = sub.add_parser("verify", help="check sizes and checksums of one checkpoint")
    p.add_argument("path")
    p.set_defaults(fn=_cmd_verify)
    p = sub.add_parser("inspect", help="print the tensor table of one checkpoint")
    p.add_argument("path")
    p.set_defaults(fn=_cmd_inspect)
    p = sub.add_parser("gc", help="remove folders of saves that died before their commit")
    p.add_argument("root")
    p.add_argument("--grace-s", type=_grace, default=CheckpointConfig.__dataclass_fields__["orphan_grace_s"].default,
                   help="only folders where nothing changed for this many seconds (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    p.set_defaults(fn=_cmd_gc)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except FastCkptError as e:
        print(f"fastckpt: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
