"""The tensor table of a meta file, validated before a byte is allocated or read.

A table row says where one tensor's bytes are: ``file`` (a shard listed in the manifest), ``offset``
and ``nbytes``, plus its ``dtype`` and ``shape``. A crafted row can make a loader read outside a file,
alias two tensors, or allocate a tensor of absurd size from a zero-byte range, so every row is checked
here, with ``verify_on_load`` on or off: bounds checks are not checksums.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from ..errors import IntegrityError
from .paths import plain_name

__all__ = ["TableEntry", "parse_table", "check_table", "parse_dtype", "numel", "MAX_DIMS"]

MAX_DIMS = 64  # torch's own limit on tensor dimensions
# dtypes whose bytes cannot be viewed or copied as a plain tensor (quantized, sub-byte): a table naming
# one would fail deep inside torch with an unnamed error, and no fastckpt writer produces them.
_UNLOADABLE = frozenset({"bit", "qint8", "qint32", "quint8", "quint4x2", "quint2x4"}
                        | {f"{sign}int{bits}" for sign in ("", "u") for bits in range(1, 8)})
_CRC_LIMIT = 1 << 32


@dataclass(frozen=True, slots=True)
class TableEntry:
    """One checked row: ``nbytes == numel(shape) * itemsize`` and ``[offset, offset + nbytes)`` lies in ``file``."""

    index: int
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int
    crc: int
    numpy: bool


def numel(shape: tuple[int, ...]) -> int:
    """The number of elements of ``shape`` (1 for a scalar)."""
    n = 1
    for s in shape:
        n *= s
    return n


def parse_dtype(name: object, source: str) -> torch.dtype:
    """The torch dtype called ``name`` (``"float32"``); IntegrityError naming ``source`` otherwise."""
    known = isinstance(name, str) and name.isidentifier() and name not in _UNLOADABLE
    dtype = getattr(torch, name, None) if known else None
    if not isinstance(dtype, torch.dtype):
        raise IntegrityError(f"{source}: unknown dtype {name!r:.80}; the file is corrupt or written by a newer torch")
    return dtype


def parse_table(rows: list[Any], files: dict[str, dict[str, int]], source: str) -> list[TableEntry]:
    """Check every row of a tensor table against the manifest's ``files`` (name -> size); no overlaps.

    Raises the first problem; called by the loader before it allocates anything.
    """
    entries, problems = check_table(rows, files, source)
    if problems:
        raise problems[0]
    return entries


def check_table(rows: list[Any], files: dict[str, dict[str, int]],
                source: str) -> tuple[list[TableEntry], list[IntegrityError]]:
    """The good rows and one error per bad row (and per overlap): ``fastckpt verify`` reports them all."""
    entries, problems = [], []
    for i, row in enumerate(rows):
        try:
            entries.append(_row(i, row, files, source))
        except IntegrityError as e:
            problems.append(e)
    try:
        _check_overlaps(entries, source)
    except IntegrityError as e:
        problems.append(e)
    return entries, problems


def _row(index: int, row: Any, files: dict[str, dict[str, int]], source: str) -> TableEntry:
    where = f"{source}: tensor table row {index}"
    if not isinstance(row, dict) or not isinstance(row.get("key"), str):
        raise IntegrityError(f"{where} is {row!r:.80}, not an object with a string 'key'")
    where = f"{where} ({row['key']!r:.80})"
    shape = row.get("shape")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise IntegrityError(f"{where}: shape {shape!r:.80} is not a list of at most {MAX_DIMS} sizes")
    dims = tuple(_int(s, "shape", where) for s in shape)
    dtype = parse_dtype(row.get("dtype"), where)
    file = plain_name(row.get("file"), "shard file", where)
    if file not in files:
        raise IntegrityError(f"{where}: points at {file!r}, which the manifest does not list")
    offset, nbytes = _int(row.get("offset"), "offset", where), _int(row.get("nbytes"), "nbytes", where)
    crc = _int(row.get("crc32c"), "crc32c", where)
    if crc >= _CRC_LIMIT or not isinstance(row.get("numpy", False), bool):
        raise IntegrityError(f"{where}: crc32c {crc} or numpy {row.get('numpy')!r:.20} is out of range")
    if row.get("numpy") and not _numpy_has(dtype):
        raise IntegrityError(f"{where}: marked as a numpy array, but numpy has no {dtype}")
    if numel(dims) * dtype.itemsize != nbytes:
        raise IntegrityError(f"{where}: {dtype} {list(dims)} takes {numel(dims) * dtype.itemsize} bytes but the "
                             f"table says {nbytes}; the file is corrupt or crafted")
    size = files[file]["size"]
    if offset + nbytes > size:
        raise IntegrityError(f"{where}: bytes [{offset}, {offset + nbytes}) lie past the end of {file!r} "
                             f"({size} bytes by the manifest)")
    return TableEntry(index, row["key"], dtype, dims, file, offset, nbytes, crc, row.get("numpy", False))


@cache
def _numpy_has(dtype: torch.dtype) -> bool:
    try:
        torch.empty(0, dtype=dtype).numpy()  # no bytes: asks torch whether numpy has this dtype
        return True
    except (TypeError, RuntimeError):
        return False


def _int(value: Any, field: str, where: str) -> int:
    if type(value) is not int or value < 0:
        raise IntegrityError(f"{where}: {field} {value!r:.80} is not a non-negative integer")
    return value


def _check_overlaps(entries: list[TableEntry], source: str) -> None:
    """Two tensors sharing bytes would alias on load (and a crafted one could shadow another's data)."""
    by_file: dict[str, list[TableEntry]] = {}
    for e in entries:
        if e.nbytes:
            by_file.setdefault(e.file, []).append(e)
    for name, group in by_file.items():
        group.sort(key=lambda e: e.offset)
        for a, b in zip(group, group[1:]):
            if b.offset < a.offset + a.nbytes:
                raise IntegrityError(f"{source}: tensors {a.key!r:.80} and {b.key!r:.80} overlap in {name!r} "
                                     f"(bytes {b.offset}..{a.offset + a.nbytes}); the file is corrupt or crafted")
