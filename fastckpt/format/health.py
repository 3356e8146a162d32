"""Health of a checkpoint: per tensor NaN/Inf counts, absolute max, L2 norm and a sampled content fingerprint.

The I/O workers measure each tensor on the staged host copy (never the training thread), right before they write
or checksum its shard; the committer sums them up (``summarize``) into the ``health`` field of the manifest (the
open layout and a framework's folder) or, for a torch file, into its extended attribute ``HEALTH_ATTR`` (a summary:
``attr_bytes``; local storage) or a sidecar file next to it (``sidecar_path``; an object store), neither of which
``torch.load`` ever reads. docs/FORMAT.md, "Health", documents the fields. The records themselves (parsing,
sidecars, attributes, what ties them to the file's bytes) live in ``healthrecord.py``, without torch; their names are
re-exported here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import batchpass, fused
from .checksum import crc32, crc32c
from .healthpass import shard_pass, tensor_pass
from .healthrecord import (HEALTH_ATTR, SIDECAR_SUFFIX, attr_bytes, check_health, content_digest, content_tie,
                           delete_with_record, file_health, fingerprints, healthy_of, parse_sidecar, sidecar_bytes,
                           sidecar_health, sidecar_path, summarize, uses_sidecar, verdict)

__all__ = ["tensor_health", "summarize", "check_health", "healthy_of", "verdict", "sidecar_path", "sidecar_bytes",
           "uses_sidecar", "delete_with_record", "parse_sidecar", "SIDECAR_SUFFIX", "fingerprints", "sidecar_health",
           "shard_health", "value_dtype", "HealthPart", "measured", "storage_dtype", "HEALTH_ATTR", "attr_bytes",
           "file_health", "content_digest", "content_tie"]


def tensor_health(raw: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """Statistics of one staged tensor: ``raw`` holds its bytes (a flat uint8 CPU tensor), ``dtype`` its values'.

    ``n`` values, NaN and Inf counts, the absolute max and the L2 norm of the finite values (groups of 512 values
    normed in float32, their squares summed in float64: relative error below 1e-6; all in float64 when squares
    overflow float32), and ``fp``: an xxh3-64 of the size and of 64 evenly spread 64-byte windows (the whole
    tensor up to 4 KiB), cheap enough for every tensor and enough to tell whether a tensor changed between two
    checkpoints. Measured in one blocked pass (format/healthpass.py), which can take the CRC32C too.
    """
    return tensor_pass(raw, dtype)[0]


def shard_health(job: Any, shard: Any, raw: torch.Tensor, fmt: Any, layout: Any = None) -> dict[str, Any]:
    """Called by an I/O worker: the statistics of each tensor of one staged shard (``raw``: its uint8 buffer),
    by key. The same pass takes the checksums the format's writer needs, so that it never reads the bytes again:
    the open layout's CRC32C (``fmt.crc32c_per_tensor``) into ``job.staged_crcs`` (unless the copy already took
    them), a torch file's CRC-32 (``fmt.pass_checksum``) into ``fmt.pass_crcs``. With ``layout`` (the shard's
    format/batchpass.py ``Layout``, on a serial thread) in a few calls a piece, else block by block."""
    checksum = getattr(fmt, "pass_checksum", None)
    crc = checksum or (getattr(fmt, "crc32c_per_tensor", False) and shard.index not in job.staged_crcs)
    got = None
    if layout is not None and getattr(job, "fused", None) is not None:  # one compiled call (format/fused.py)
        got = fused.run(job.fused, layout, tensors=None, health=True,
                        checksum="crc32" if checksum is crc32 else "crc32c" if checksum is None else "")
    if layout is not None:
        by_pos, measured_ = got or batchpass.run(layout, raw, checksum=checksum or (crc32c if crc else None),
                                                 health=True)
        stats = {job.keys[e.index]: measured_[pos] for pos, e in enumerate(layout.entries)}
        crcs = by_pos if crc else None
    else:
        stats, crcs = shard_pass(raw, shard.entries, job.keys, lambda e: value_dtype(fmt, e), crc)
    if crcs is not None:
        (fmt.pass_crcs if checksum is not None else job.staged_crcs)[shard.index] = crcs
    return stats


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
