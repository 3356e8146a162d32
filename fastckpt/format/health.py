"""Health of a checkpoint: per tensor NaN/Inf counts, absolute max, L2 norm and a sampled content fingerprint.

The I/O workers measure each tensor on the staged host copy (never the training thread), right before they write
or checksum its shard; the committer sums them up (``summarize``) into the ``health`` field of the manifest (the
open layout and a framework's folder) or, for a torch file, into its extended attribute ``HEALTH_ATTR`` (a summary:
``attr_bytes``; local storage) or a sidecar file next to it (``sidecar_path``; an object store), neither of which
``torch.load`` ever reads. docs/FORMAT.md, "Health", documents the fields.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import xxhash

from ..errors import IntegrityError
from .torchrecords import records_path

__all__ = ["tensor_health", "summarize", "check_health", "healthy_of", "sidecar_path", "sidecar_bytes", "uses_sidecar", "delete_with_record",
           "parse_sidecar", "SIDECAR_SUFFIX", "fingerprints", "sidecar_health", "shard_health", "value_dtype",
           "HealthPart", "measured", "storage_dtype", "HEALTH_ATTR", "attr_bytes", "file_health"]

SIDECAR_SUFFIX = ".fastckpt-health.json"
HEALTH_ATTR = "user.fastckpt.health"  # a local torch file's record: an extended attribute of the file itself
_CHUNK = 1 << 22  # elements measured at once: bounds the float64 temporaries of a large tensor to 32 MiB
_BLOCK = 512  # values normed together in float32 before the float64 sum (``_squares``)
_WINDOWS = 64  # sampled windows of the fingerprint...
_WINDOW = 64  # ...of this many bytes each: 4 KiB read per tensor, whatever its size
_COUNT_FIELDS = ("nan", "inf")


def tensor_health(raw: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """Statistics of one staged tensor: ``raw`` holds its bytes (a flat uint8 CPU tensor), ``dtype`` its values'.

    ``n`` values, NaN and Inf counts, the absolute max and the L2 norm of the finite values (squares summed in
    float64: ``_squares``), and
    ``fp``: an xxh3-64 of the size and of 64 evenly spread 64-byte windows (the whole tensor up to 4 KiB), cheap
    enough for every tensor and enough to tell whether a tensor changed between two checkpoints.
    """
    nbytes = raw.numel()
    nan = inf = 0
    absmax = 0.0
    squares = 0.0
    values = _values(raw, dtype)
    for start in range(0, values.numel(), _CHUNK):
        chunk = values[start:start + _CHUNK]
        if not chunk.is_floating_point():
            chunk = chunk.to(torch.float64)  # integers: exact up to 2**53, and int64's minimum has an abs()
        lo, hi = torch.aminmax(chunk)  # one pass; a NaN or an Inf anywhere shows here (NaN propagates)
        if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):  # rare: count them, measure the rest
            nan, inf = nan + int(torch.isnan(chunk).sum()), inf + int(torch.isinf(chunk).sum())
            chunk = chunk[torch.isfinite(chunk)]
            if not chunk.numel():
                continue
            lo, hi = torch.aminmax(chunk)
        absmax = max(absmax, -float(lo), float(hi))
        squares += _squares(chunk)
    l2 = math.sqrt(squares)
    return {"n": values.numel(), "nan": nan, "inf": inf, "absmax": absmax if math.isfinite(absmax) else None,
            "l2": l2 if math.isfinite(l2) else None, "fp": _fingerprint(raw.numpy(), nbytes)}


def _squares(values: torch.Tensor) -> float:
    """The sum of squares of finite ``values``: blocks of 512 values normed by torch in float32 (10x faster than
    converting every value to float64), the blocks' squares summed in float64 (relative error below 1e-6, ~1e-9 on
    random values); all in float64 when a block overflows float32 (values beyond ~1e19)."""
    wide = values.dtype == torch.float64
    n = values.numel() - values.numel() % _BLOCK
    parts = []
    if n:
        parts.append(torch.linalg.vector_norm(values[:n].view(-1, _BLOCK), dim=1,
                                              dtype=None if wide else torch.float32))
    if n < values.numel():
        parts.append(torch.linalg.vector_norm(values[n:], dtype=torch.float64).reshape(1))
    norms = torch.cat([p.to(torch.float64) for p in parts])
    if not wide and not bool(torch.isfinite(norms).all()):
        return float(torch.linalg.vector_norm(values, dtype=torch.float64)) ** 2
    return float(norms.square().sum())


def _values(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``raw``'s bytes as flat values the statistics can run on (float32 for the float8 kinds)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if raw.numel() % size:
        return raw  # not a whole number of values: measured as bytes
    # a torch file's records are staged back to back as bytes: one may start off its dtype's alignment
    t = (raw if raw.storage_offset() % size == 0 else raw.clone()).view(dtype)
    if t.is_complex():
        return torch.view_as_real(t).reshape(-1)
    if t.is_floating_point() and t.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return t.to(torch.float32)  # float8 kinds: no reductions of their own
    return t


def _fingerprint(data: Any, nbytes: int) -> str:
    h = xxhash.xxh3_64()
    h.update(nbytes.to_bytes(8, "little"))
    mv = memoryview(data)
    if nbytes <= _WINDOWS * _WINDOW:
        h.update(mv)
    else:
        last = nbytes - _WINDOW
        for k in range(_WINDOWS):
            at = k * last // (_WINDOWS - 1)
            h.update(mv[at:at + _WINDOW])
    return h.hexdigest()


def summarize(per_tensor: dict[str, dict[str, Any]], complete: bool = True) -> dict[str, Any]:
    """The ``health`` record of a checkpoint from its tensors' statistics (by key). ``complete``: every tensor was
    measured (ranks sharing a checkpoint measure only their own shards: the others' keys are absent)."""
    nan = sum(s["nan"] for s in per_tensor.values())
    inf = sum(s["inf"] for s in per_tensor.values())
    # An infinite scalar is a sentinel by design (ModelCheckpoint's best and k-th scores start at inf): only an Inf
    # among many values is a diverged tensor. An incomplete measurement proves nothing.
    diverged = nan or any(s["inf"] and s.get("n", 0) > 1 for s in per_tensor.values())
    return {"healthy": not diverged and complete, "nan": nan, "inf": inf, "complete": complete,
            "tensors": dict(sorted(per_tensor.items()))}


def check_health(value: Any, source: str) -> dict[str, Any]:
    """``value`` (a manifest's or a sidecar's ``health``) checked; IntegrityError names ``source`` and the field."""
    if not isinstance(value, dict) or type(value.get("healthy")) is not bool:
        raise IntegrityError(f"{source}: field 'health' must be an object with a boolean 'healthy'; the file is "
                             "corrupt or crafted")
    for field in _COUNT_FIELDS:
        if type(value.get(field, 0)) is not int or value.get(field, 0) < 0:
            raise IntegrityError(f"{source}: field 'health.{field}' is {value.get(field)!r:.80}, not a count")
    if value["healthy"] and value.get("nan", 0):
        raise IntegrityError(f"{source}: field 'health' says healthy but counts NaN values; the file is "
                             "corrupt or crafted")
    if not isinstance(value.get("tensors", {}), dict):
        raise IntegrityError(f"{source}: field 'health.tensors' is not an object")
    return value


def healthy_of(doc: dict[str, Any]) -> bool | None:
    """A parsed manifest's verdict: True or False when measured, None when it carries none (older fastckpt,
    or ``health.enabled: false``)."""
    health = doc.get("health")
    return None if health is None else bool(health["healthy"])


def fingerprints(health: dict[str, Any] | None, keys: Iterable[str]) -> dict[str, str]:
    """The content fingerprints of ``keys`` in a ``health`` record (those it measured)."""
    tensors = (health or {}).get("tensors", {})
    return {k: tensors[k]["fp"] for k in keys if isinstance(tensors.get(k), dict) and "fp" in tensors[k]}


# ---- the sidecar of a torch file (Lightning's ``.ckpt``) -----------------------------------------------------


def sidecar_path(path: str) -> str:
    """The sidecar of the torch file at ``path``: a hidden JSON file beside it (``.NAME.fastckpt-health.json``),
    which ``torch.load``, Lightning's ``*.ckpt`` listings and ``ls`` never see."""
    folder, sep, name = path.rpartition("/")
    return f"{folder}{sep}.{name}{SIDECAR_SUFFIX}"


def uses_sidecar(storage: Any) -> bool:
    """Whether torch files on ``storage`` keep their health record in a sidecar (an object store: no extended
    attributes) rather than in the file's own attribute (local storage, ``set_attrs``)."""
    return getattr(storage, "set_attrs", None) is None


def delete_with_record(storage: Any, path: str) -> None:
    """Delete the torch file at ``path`` and its health record: gone with the file where it is an attribute; the
    sidecars (health, content records) only where sidecars are written, so a user's file that merely has the sidecar's name stays."""
    storage.delete(path)
    if uses_sidecar(storage):
        storage.delete(sidecar_path(path))
        storage.delete(records_path(path))  # its content records (torchrecords.py), the next upload's copy source


def sidecar_bytes(health: dict[str, Any], step: int, size: int) -> bytes:
    """The sidecar's content: the health record plus the file's step and size, so that a sidecar left beside
    another file of the same name (a crash between the file's rename and its sidecar's) is told apart."""
    return json.dumps({"format": "fastckpt-health", "step": step, "size": size, "health": health}).encode()


def parse_sidecar(data: bytes, size: int, source: str) -> dict[str, Any] | None:
    """The health record of a sidecar read from ``source`` (with the file's ``step``), or None when it belongs to
    another file (its size differs from the file's ``size``); IntegrityError when malformed."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise IntegrityError(f"{source}: not valid JSON ({type(e).__name__}); delete the sidecar (the checkpoint "
                             "beside it then has no health record)") from e
    if not isinstance(doc, dict) or doc.get("format") != "fastckpt-health" or type(doc.get("size")) is not int:
        raise IntegrityError(f"{source}: not a fastckpt health sidecar; delete it")
    if doc["size"] != size:
        return None
    health = check_health(doc.get("health"), source)
    return {**health, "step": doc["step"]} if type(doc.get("step")) is int else health


def attr_bytes(health: dict[str, Any], step: int, size: int) -> bytes:
    """The record kept in a local torch file's extended attribute ``HEALTH_ATTR``: the sidecar's envelope with a
    summary (verdict, NaN/Inf totals, tensor count, an xxh3 of the per-tensor fingerprints) instead of the
    per-tensor table, so that it stays a few hundred bytes whatever the model (ext4 keeps ~4 KB of attributes)."""
    prints = xxhash.xxh3_64()
    for key, stats in sorted(health.get("tensors", {}).items()):
        prints.update(f"{key}\0{stats.get('fp', '')}\0".encode())
    summary = {k: health[k] for k in ("healthy", "nan", "inf", "complete") if k in health}
    summary.update(count=len(health.get("tensors", {})), fp=prints.hexdigest())
    return sidecar_bytes(summary, step, size)


def file_health(storage: Any, path: str) -> dict[str, Any] | None:
    """The health record of the torch file at ``path`` (a ``Storage`` path): on local storage its extended
    attribute ``HEALTH_ATTR``, elsewhere (object stores keep no attributes) its sidecar. None when it has none, or
    one left by another file of that name. A malformed record raises ``IntegrityError``."""
    get = getattr(storage, "get_attr", None)
    if get is None:
        return sidecar_health(storage, path)
    try:
        data = get(path, HEALTH_ATTR)
        if data is None:
            return None
        return parse_sidecar(data, storage.size(path), f"{path} (extended attribute {HEALTH_ATTR})")
    except FileNotFoundError:
        return None


def sidecar_health(storage: Any, path: str) -> dict[str, Any] | None:
    """The health record of the torch file at ``path`` (a ``Storage`` path), read from its sidecar; None when it
    has none, or one left by another file of that name. A malformed sidecar raises ``IntegrityError``."""
    side = sidecar_path(path)
    try:
        data = storage.read_bytes(side)
        size = storage.size(path)
    except FileNotFoundError:
        return None
    return parse_sidecar(data, size, side)


def shard_health(raw: torch.Tensor, entries: Sequence[Any], keys: list[str], dtypes: Any) -> dict[str, Any]:
    """Called by an I/O worker: the statistics of each tensor of one staged shard (``raw``: its uint8 buffer),
    by key; ``dtypes(entry)``: the dtype of an entry's values."""
    return {keys[e.index]: tensor_health(raw[e.offset:e.offset + e.nbytes], dtypes(e)) for e in entries}


def value_dtype(fmt: Any, entry: Any) -> torch.dtype:
    """The dtype of an entry's values: a torch file stages whole storages as bytes, and knows each one's type."""
    of = getattr(fmt, "value_dtype", None)
    return of(entry) if of is not None else entry.dtype


def storage_dtype(type_name: str) -> torch.dtype:
    """The dtype of a storage type torch pickles (``FloatStorage`` -> float32); bytes when unknown."""
    return _STORAGE_DTYPES.get(type_name, torch.uint8)


# By name, not through ``torch.FloatStorage.dtype``: that access warns that TypedStorage is deprecated.
_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128,
}


@dataclass(frozen=True)
class HealthPart:
    """One rank's tensor statistics, travelling with its shard results to the committing rank (pickled)."""

    tensors: dict[str, Any]


def measured(job: Any, merged: list[Any]) -> list[Any]:
    """On the committing rank: ``merged`` without the ``HealthPart`` items, whose statistics join ``job.health``."""
    parts = [m for m in merged if isinstance(m, HealthPart)]
    if job.health is not None:
        for part in parts:
            job.health.update(part.tensors)
    return [m for m in merged if not isinstance(m, HealthPart)]
