"""Check one checkpoint completely and report every problem, not just the first.

``fastckpt verify`` uses this: each listed file's presence, size and CRC32C (also files no tensor
refers to), the tensor table against the manifest (bounds, byte counts, overlaps), each shard's
header length, the tree and the pickled objects. A load stops at the first problem; an operator
deciding whether a checkpoint can be trusted wants the whole list.
"""
from __future__ import annotations

from typing import Any

from ..format.checksum import crc32c
from ..format.codec import loads_objects
from ..errors import FastCkptError, IntegrityError
from ..format.layout import LAYOUT_FILES, MANIFEST, check_shard_header, parse_manifest, parse_meta
from .loader import CheckpointReader
from ..format.paths import confine
from ..storage.protocol import Storage
from ..storage.s3checksum import expected_like
from ..format.table import TableEntry, check_table

__all__ = ["verify_checkpoint"]


def verify_checkpoint(storage: Storage, dirpath: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The parsed manifest (None if unreadable) and one line per problem found in ``dirpath``."""
    mpath = storage.join(dirpath, MANIFEST)
    try:
        manifest = parse_manifest(storage.read_bytes(mpath), mpath)
    except FileNotFoundError:
        return None, [f"{mpath}: missing; {dirpath} is not a committed checkpoint (the save never committed, "
                      "or the path is wrong)"]
    except FastCkptError as e:
        return None, [str(e)]
    problems: list[str] = []
    if manifest.get("layout") == LAYOUT_FILES:  # a framework's own files (fastckpt.format.bundle): each whole file's CRC32C
        for name, rec in manifest["files"].items():
            _read(storage, dirpath, name, rec, problems)
        return manifest, problems
    meta_name = manifest["meta"]
    meta_bytes = _read(storage, dirpath, meta_name, manifest["files"][meta_name], problems)
    entries, objects = _check_meta(storage.join(dirpath, meta_name), manifest, meta_bytes, problems)
    for name, rec in manifest["files"].items():
        if name == meta_name:
            continue
        data = _read(storage, dirpath, name, rec, problems)  # one file in memory at a time
        rows = [e for e in entries if e.file == name]
        if data is not None and rows:
            _check_shard(storage.join(dirpath, name), data, rows, problems)
        if data is not None and name == objects:
            try:
                loads_objects(data, [], storage.join(dirpath, name))
            except FastCkptError as e:
                problems.append(str(e))
    if not problems:  # the files are sound: now the structure (DTensor records, the tree) as a load sees it
        try:
            CheckpointReader(storage, dirpath, verify=False).check_structure()
        except FastCkptError as e:
            problems.append(str(e))
    return manifest, problems


def _read(storage: Storage, dirpath: str, name: str, rec: dict[str, int], problems: list[str]) -> bytes | None:
    """The file's bytes if present and of the listed size (a CRC mismatch is reported, the bytes returned)."""
    path = storage.join(dirpath, name)
    try:
        confine(dirpath, path, f"{dirpath}: file {name!r}")
        data = storage.read_bytes(path)
    except FileNotFoundError:
        problems.append(f"{path}: listed in the manifest but missing")
        return None
    except FastCkptError as e:
        problems.append(str(e))
        return None
    if len(data) != rec["size"]:
        problems.append(f"{path}: size is {len(data)} bytes but the manifest says {rec['size']}")
        return None
    if crc32c(data) != rec["crc32c"]:
        problems.append(f"{path}: checksum mismatch (CRC32C {crc32c(data):#010x}, manifest {rec['crc32c']:#010x})")
    _check_stored(storage, path, data, problems)
    return data


def _check_stored(storage: Storage, path: str, data: bytes, problems: list[str]) -> None:
    """The checksum an S3 store keeps for the object (``storage/s3checksum.py``) against the bytes read."""
    stored = getattr(storage, "object_checksum", None)
    try:
        server = stored(path) if stored is not None else None
    except FastCkptError as e:
        problems.append(f"{path}: the store's checksum could not be read: {e}")
        return
    expected = expected_like(data, server) if server is not None else None
    if expected is not None and expected != server:
        problems.append(f"{path}: the store keeps checksum {server!r} for the object but its bytes give {expected!r}: "
                        "the object is not what was uploaded; upload the checkpoint again")


def _check_shard(path: str, data: bytes, rows: list[TableEntry], problems: list[str]) -> None:
    """The header length, and each tensor's own CRC32C (which names the damaged tensor)."""
    view = memoryview(data)
    try:
        check_shard_header(data[:8], len(data), min((e.offset for e in rows if e.nbytes), default=None), path)
    except IntegrityError as e:
        problems.append(str(e))
    for e in rows:
        if crc32c(view[e.offset: e.offset + e.nbytes]) != e.crc:
            problems.append(f"{path}: checksum mismatch in tensor {e.key!r} (bytes {e.offset}..{e.offset + e.nbytes})")


def _check_meta(source: str, manifest: dict[str, Any], data: bytes | None,
                problems: list[str]) -> tuple[list[TableEntry], str | None]:
    """The good rows of the tensor table and the objects file name (none if the meta file is bad)."""
    if data is None:
        return [], None
    try:
        meta = parse_meta(data, source)
    except IntegrityError as e:
        problems.append(str(e))
        return [], None
    entries, bad = check_table(meta["tensors"], manifest["files"], source)
    problems.extend(str(e) for e in bad)
    objects = meta.get("objects")
    if objects and objects not in manifest["files"]:
        problems.append(f"{source}: the objects file {objects!r} is not listed in the manifest")
    return entries, objects
