"""A checkpoint's health record, read and written as data: the manifest's ``health`` field, a torch file's extended
attribute ``HEALTH_ATTR`` or its sidecar, each tied to the bytes it was measured on. No torch here: ``fastckpt list``
and the catalogs read these records without importing it. The measuring (``health.py``) fills them. docs/FORMAT.md,
"Health", documents the fields.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Callable, Iterable

import xxhash

from ..errors import IntegrityError
from .torchrecords import records_path
from .zipdir import directory_digest, read_directory

__all__ = ["summarize", "check_health", "healthy_of", "verdict", "sidecar_path", "sidecar_bytes", "uses_sidecar",
           "delete_with_record", "parse_sidecar", "SIDECAR_SUFFIX", "fingerprints", "sidecar_health", "HEALTH_ATTR",
           "attr_bytes", "file_health", "content_digest", "content_tie"]

SIDECAR_SUFFIX = ".fastckpt-health.json"
HEALTH_ATTR = "user.fastckpt.health"  # a local torch file's record: an extended attribute of the file itself
_COUNT_FIELDS = ("nan", "inf")


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
    """A parsed manifest's verdict (``verdict`` of its ``health``): True or False when measured, None when it
    carries none (older fastckpt, or ``health.enabled: false``) or one that contradicts itself."""
    return verdict(doc.get("health"))


def verdict(health: dict[str, Any] | None) -> bool | None:
    """What a checked ``health`` record (``check_health``; a manifest's, a sidecar's or a file attribute's summary)
    proves: False when it says unhealthy; True only when it says healthy, was ``complete`` and agrees with its own
    per-tensor rows (where it carries them: the summary of a file attribute has none); None otherwise, like no
    record at all. A record is data anyone can edit or craft: ``healthy: true`` beside ``complete: false``, or
    beside a row counting NaNs, is believed neither way (never chosen as healthy, never removed as sick)."""
    if health is None:
        return None
    if not health["healthy"]:
        return False
    if health.get("complete") is not True or health.get("nan", 0):
        return None
    rows = health.get("tensors", {})
    nan = inf = 0
    for stats in rows.values():
        if not isinstance(stats, dict) or not all(type(stats.get(f)) is int and stats[f] >= 0 for f in _COUNT_FIELDS):
            return None  # a row without its counts proves nothing
        if stats["nan"] or (stats["inf"] and (type(stats.get("n")) is not int or stats["n"] > 1)):
            return None  # a diverged tensor (summarize's rule) under a healthy verdict
        nan, inf = nan + stats["nan"], inf + stats["inf"]
    if rows and (nan, inf) != (health.get("nan", 0), health.get("inf", 0)):
        return None  # totals that are not the rows' sums
    return True


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


def sidecar_bytes(health: dict[str, Any], step: int, size: int, digest: str | None) -> bytes:
    """The sidecar's content: the health record plus the file's step, size and ``zip`` digest (its records'
    CRC-32s: ``zipdir.directory_digest``), so that a sidecar left beside other bytes of that name (a crash between
    the file's rename and its sidecar's, a file copied or uploaded over it) is told apart."""
    return json.dumps({"format": "fastckpt-health", "step": step, "size": size, "zip": digest,
                       "health": health}).encode()


def parse_sidecar(data: bytes, size: int, source: str, digest: Callable[[], str]) -> dict[str, Any] | None:
    """The health record of a sidecar read from ``source`` (with the file's ``step``), or None when it belongs to
    other bytes: its size differs from the file's ``size``, or its ``zip`` digest from ``digest()`` (the file's as
    it is now: ``content_digest``, called only when the sizes agree), or it has none (an older fastckpt's record,
    which nothing ties to these bytes). IntegrityError when malformed."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise IntegrityError(f"{source}: not valid JSON ({type(e).__name__}); delete the sidecar (the checkpoint "
                             "beside it then has no health record)") from e
    if not isinstance(doc, dict) or doc.get("format") != "fastckpt-health" or type(doc.get("size")) is not int:
        raise IntegrityError(f"{source}: not a fastckpt health sidecar; delete it")
    if doc["size"] != size or not isinstance(doc.get("zip"), str) or doc["zip"] != digest():
        return None
    health = check_health(doc.get("health"), source)
    return {**health, "step": doc["step"]} if type(doc.get("step")) is int else health


def attr_bytes(health: dict[str, Any], step: int, size: int, digest: str | None) -> bytes:
    """The record kept in a local torch file's extended attribute ``HEALTH_ATTR``: the sidecar's envelope with a
    summary (verdict, NaN/Inf totals, tensor count, an xxh3 of the per-tensor fingerprints) instead of the
    per-tensor table, so that it stays a few hundred bytes whatever the model (ext4 keeps ~4 KB of attributes).
    ``digest``: the file's ``zipdir.directory_digest``; ``cp other.ckpt a.ckpt`` rewrites a.ckpt in place, keeping
    its attribute, and the digest is what tells that record from the new bytes."""
    prints = xxhash.xxh3_64()
    for key, stats in sorted(health.get("tensors", {}).items()):
        prints.update(f"{key}\0{stats.get('fp', '')}\0".encode())
    summary = {k: health[k] for k in ("healthy", "nan", "inf", "complete") if k in health}
    summary.update(count=len(health.get("tensors", {})), fp=prints.hexdigest())
    return sidecar_bytes(summary, step, size, digest)


def content_tie(fmt: Any, crcs: dict[int, int]) -> str | None:
    """The digest a file's health record is tied to, from the CRC-32s its writer measured (``crcs``, by record):
    a torch file's ``directory_digest``; None for a format without a zip directory (such a record is never
    believed: ``parse_sidecar``)."""
    digest = getattr(fmt, "directory_digest", None)
    return None if digest is None else digest(crcs)


def content_digest(storage: Any, path: str, size: int) -> str | None:
    """The ``zipdir.directory_digest`` of the torch file at ``path`` as it is now (two small reads of its end);
    None when it has no readable zip directory (then no record belongs to it)."""
    def read(offset: int, n: int) -> bytes:
        out = bytearray(n)
        storage.read_into(path, offset, memoryview(out))
        return bytes(out)

    try:
        return directory_digest(read_directory(read, size))
    except (IntegrityError, struct.error, ValueError, IndexError):
        return None


def file_health(storage: Any, path: str) -> dict[str, Any] | None:
    """The health record of the torch file at ``path`` (a ``Storage`` path): on local storage its extended
    attribute ``HEALTH_ATTR``, elsewhere (object stores keep no attributes) its sidecar. None when it has none, or
    one measured on other bytes (another file of that name, or one copied over it: checked against the file's
    zip directory, its records' CRC-32s). A malformed record raises ``IntegrityError``."""
    get = getattr(storage, "get_attr", None)
    if get is None:
        return sidecar_health(storage, path)
    try:
        data = get(path, HEALTH_ATTR)
        if data is None:
            return None
        size = storage.size(path)
        return parse_sidecar(data, size, f"{path} (extended attribute {HEALTH_ATTR})",
                             lambda: content_digest(storage, path, size))
    except FileNotFoundError:
        return None


def sidecar_health(storage: Any, path: str) -> dict[str, Any] | None:
    """The health record of the torch file at ``path`` (a ``Storage`` path), read from its sidecar; None when it
    has none, or one measured on other bytes (``file_health``). A malformed sidecar raises ``IntegrityError``."""
    side = sidecar_path(path)
    try:
        data = storage.read_bytes(side)
        size = storage.size(path)
    except FileNotFoundError:
        return None
    return parse_sidecar(data, size, side, lambda: content_digest(storage, path, size))
