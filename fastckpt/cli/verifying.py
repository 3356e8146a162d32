"""``fastckpt verify CKPT...``: every checksum of every named checkpoint; exit 1 if any is bad.

Core folders: ``fastckpt.read.verify`` (each file's size and CRC32C, each tensor's CRC32C, the tree).
Torch files (Lightning ``.ckpt``): each zip record's CRC-32 (``fastckpt.format.torchfile``). fastckpt 0.1
pointers: each core folder they name. Accelerate folders: ``verify_accelerate_folder``.

A folder that is no checkpoint but holds some (a core root, a Lightning dirpath, an Accelerate project or its
``checkpoints/``) stands for every checkpoint ``fastckpt list`` shows under it: each is verified and reported on
its own line. Saves that never committed (``list``'s ``uncommitted``: gc's to remove) are named and skipped.
"""
from __future__ import annotations

import argparse
import json
import struct
import sys
from dataclasses import replace
from typing import Any, Callable

from ..errors import CheckpointNotFoundError, FastCkptError, IntegrityError
from ..format.manifest import MANIFEST
from ..tiers.gc import is_save_folder
from .. import LocalStorage
from .layout import Located, checkpoint_bytes, children, kind_of, locate, pointer_parts
from .options import CliOptions
from .progress import ByteProgress, CountingStorage, wanted
from .text import clean

__all__ = ["verify_path", "verify_accelerate_folder", "checkpoints_under", "run"]

Count = Callable[[int], None]


def verify_path(path: str, opts: CliOptions, count: Count | None = None) -> list[str]:
    """One line per problem in the checkpoint at ``path`` (empty: every checksum matched). ``count(n)`` is told
    of the bytes checked as they are (``fastckpt.cli.progress``)."""
    try:
        loc = locate(path, opts.storage_options)
        kind = kind_of(loc)
        if kind == "core":
            return _core(loc, opts.storage_options, count)
        if kind == "pointer":
            parts = pointer_parts(loc) or []
            return [p for part in parts for p in _core(Located(loc.storage, part), opts.storage_options, count)]
        if kind == "torch":
            return _torch_file(loc, count)
        if kind == "accelerate":
            return verify_accelerate_folder(loc, opts.storage_options, count)
        return [f"{loc.path}: a DCP checkpoint carries no checksums; there is nothing fastckpt can verify"]
    except FastCkptError as e:
        return [str(e)]


def verify_accelerate_folder(loc: Located, options: dict[str, Any], count: Count | None = None) -> list[str]:
    """An Accelerate ``checkpoint_N/`` folder: through its fastckpt manifest when it has one; else each torch
    file's zip CRC-32s and each safetensors header (stock files carry no other checksum).

    The Accelerate integration's format is being settled: this one function is where its dispatch lives.
    """
    names = children(loc) or []
    if MANIFEST in names:
        return _core(loc, options, count)
    problems: list[str] = []
    for name in names:
        file = Located(loc.storage, loc.storage.join(loc.path, name))
        if name.endswith(".safetensors"):
            problems += _safetensors_header(file, count)
        elif _head(file) == b"PK\x03\x04":
            problems += _torch_file(file, count)
    return problems


def _core(loc: Located, options: dict[str, Any], count: Count | None = None) -> list[str]:
    from .. import open_storage
    from ..read.verify import verify_checkpoint

    storage = open_storage(loc.path, options)
    # Counted only while someone watches: the wrapper hides LocalStorage's fast paths from the reader.
    return verify_checkpoint(storage if count is None else CountingStorage(storage, count), storage.url)[1]


def _torch_file(loc: Located, count: Count | None = None) -> list[str]:
    from ..format.torchfile import verify_torch_bytes, verify_torch_file

    if isinstance(loc.storage, LocalStorage):
        return verify_torch_file(loc.path, count)
    storage = loc.storage if count is None else CountingStorage(loc.storage, count)
    data = storage.read_bytes(loc.path)  # counted as it is read; the CRC pass over memory is not counted again
    return verify_torch_bytes(data, loc.path)


def _head(loc: Located) -> bytes:
    buf = bytearray(min(4, loc.storage.size(loc.path)))
    loc.storage.read_into(loc.path, 0, memoryview(buf))
    return bytes(buf)


def _safetensors_header(loc: Located, count: Count | None = None) -> list[str]:
    """The header parses and its tensors tile the data section exactly (no CRC exists to check)."""
    data = (loc.storage if count is None else CountingStorage(loc.storage, count)).read_bytes(loc.path)
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{loc.path}: not a readable safetensors file: {e}"]
    end = 0
    for start, stop in spans:
        if start != end or stop < start:
            return [f"{loc.path}: the safetensors header's tensors do not tile the data (gap or overlap at byte "
                    f"{start})"]
        end = stop
    if 8 + n + end != len(data):
        return [f"{loc.path}: the file is {len(data)} bytes but its safetensors header says {8 + n + end}"]
    return []


def checkpoints_under(path: str, opts: CliOptions) -> list[str] | None:
    """The checkpoints ``path`` stands for: None when it is one (or names nothing: ``verify_path`` says so); else
    every committed (or damaged, torn...) checkpoint ``fastckpt list`` shows under it, oldest first. Raises
    ``IntegrityError`` (the reason it is no checkpoint) when it holds none either."""
    try:
        loc = locate(path, opts.storage_options)
        kind_of(loc)
        return None
    except IntegrityError as e:
        if isinstance(e, CheckpointNotFoundError):
            return None
        names = children(loc)
        if names is None or is_save_folder(names):  # a file, or a checkpoint that lost its manifest: its own error
            return None
    except FastCkptError:
        return None
    from .listing import list_root

    rows = list_root(path, replace(opts, remote_url=None))  # the tier named on the line, not the config's remote
    for row in rows:
        if row.status == "uncommitted":
            print(clean(f"fastckpt: note: skipped {row.path}: a save that never committed (`fastckpt gc` removes "
                        "it)"), file=sys.stderr)
    paths = [row.path for row in rows if row.status != "uncommitted"]
    if not paths:
        raise IntegrityError(f"{loc.path}: no checkpoint, and none under it (it is no core root, Lightning dirpath "
                             "or Accelerate project holding one): nothing to verify; pass a checkpoint or a folder "
                             "of them")
    return paths


def run(args: argparse.Namespace, opts: CliOptions) -> int:
    bad = 0
    show = wanted(args.progress)
    paths = []
    for path in args.paths:
        under = checkpoints_under(path, opts)
        paths += [path] if under is None else under
    for path in paths:
        total = _total(path, opts) if show else 0
        with ByteProgress(f"verifying {path}", total, show) as bar:
            problems = verify_path(path, opts, bar.add if show else None)
        for line in problems:  # one line per problem, so that scripts can count and grep them
            print(f"fastckpt: error: {clean(' '.join(line.split()))}", file=sys.stderr)
        if problems:
            bad += 1
        else:
            print(f"OK  {clean(path)}")
    return 1 if bad else 0


def _total(path: str, opts: CliOptions) -> int:
    try:
        return checkpoint_bytes(path, opts.storage_options)
    except FastCkptError:
        return 0  # verify_path reports the path's own problem
