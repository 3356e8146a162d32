"""What a checkpoint folder is, before ``load_state`` reads it; checks a native folder against its manifest.

A folder fastckpt wrote in Accelerate's native format holds the stock files plus ``manifest.json``
(``"layout": "files"``: each file's size and CRC32C), written last: its presence is the commit. While a save
runs, the folder holds ``.fastckpt-pending`` (``fastckpt.format.bundle``); stock Accelerate would read the partial files
of a killed save, fastckpt refuses them. Older fastckpt versions wrote the core layout (shards + manifest).
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

from fastckpt import open_storage
from fastckpt.format.bundle import PENDING
from fastckpt.errors import CheckpointNotFoundError, FastCkptError, IntegrityError
from fastckpt.format.manifest import LAYOUT_FILES, MANIFEST, parse_manifest
from fastckpt.read.verify import verify_checkpoint

__all__ = ["CORE", "FILES", "STOCK", "inspect_folder", "local_folder", "unlisted_files"]

FILES, CORE, STOCK = "files", "core", "stock"


def inspect_folder(path: str, options: dict | None, verify: bool) -> tuple[str, dict[str, Any]]:
    """``(kind, the manifest)`` (``{}`` for a stock folder); a native folder's files are checked first when
    ``verify`` (the fast load checks them as it reads them instead: ``fastload``).

    Raises ``CheckpointNotFoundError`` for an uncommitted fastckpt folder and ``IntegrityError`` naming the
    first damaged file."""
    storage = open_storage(path, options)
    mpath = storage.join(storage.url, MANIFEST)
    try:
        doc = parse_manifest(storage.read_bytes(mpath), mpath)
    except FileNotFoundError:
        if storage.exists(storage.join(storage.url, PENDING)):
            raise CheckpointNotFoundError(
                f"{path} is a fastckpt checkpoint whose save never committed ({MANIFEST} is missing, "
                f"{PENDING} is there: the process died or the save failed while writing it); its files may be "
                "partial: load an older checkpoint") from None
        return STOCK, {}
    if doc.get("layout") != LAYOUT_FILES:
        return CORE, {}
    if verify:
        _, problems = verify_checkpoint(storage, storage.url)
        if problems:
            raise IntegrityError(f"checkpoint {path} is corrupt: {problems[0]}"
                                 + (f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else "")
                                 + "; load an older one with accelerator.load_state(<path>)")
    return FILES, doc


@contextmanager
def local_folder(path: str, options: dict | None) -> Iterator[str]:
    """``path`` itself when local; else a temporary local copy of the files its manifest lists (stock
    ``load_state`` reads local folders only)."""
    if "://" not in path or path.startswith("file://"):
        yield path
        return
    storage = open_storage(path, options)
    mpath = storage.join(storage.url, MANIFEST)
    try:
        names = list(parse_manifest(storage.read_bytes(mpath), mpath)["files"])
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{path}: no {MANIFEST}; only committed fastckpt folders load from a URL") from e
    with tempfile.TemporaryDirectory(prefix="fastckpt-accelerate-") as tmp:
        for name in names:
            try:
                data = storage.read_bytes(storage.join(storage.url, name))
            except (OSError, FastCkptError) as e:
                raise CheckpointNotFoundError(f"{path}: cannot read listed file {name!r} ({e})") from e
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        yield tmp


def unlisted_files(folder: str, manifest: dict[str, Any]) -> list[str]:
    """Files of the local native ``folder`` its manifest does not list (fastckpt's dotfiles aside): no file of the save
    fastckpt committed, so a load that leaves the reading to stock may read them unchecked."""
    listed = set(manifest.get("files") or {}) | {MANIFEST}
    return sorted(n for n in os.listdir(folder) if n not in listed and not n.startswith(".")
                  and os.path.isfile(os.path.join(folder, n)))
