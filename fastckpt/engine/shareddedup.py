"""Dedup of one S3 object uploaded by several ranks (``sharedobject.py``): the unchanged ranges of the torch file are
copied server-side from the folder's newest ``.ckpt`` (its records sidecar, ``format/torchrecords.py``), or for a file
in a folder of the root (Accelerate's ``checkpoint_N/NAME``) from the previous file of its name (its records under the
root, ``format/rootrecords.py``), instead of sent, as a single writer's file is (``format/objectdedup.py``).

Each rank hashes its own staged records (xxh3-128, on the committer thread, once the save is staged) and sends the
hashes to rank 0 with its CRC-32s; rank 0 tiles the file with the fixed bytes, reads the previous records and plans
(``plan_object``); the plan goes to every rank with the fixed bytes. A copied part moves no record bytes between
ranks: each rank sends rank 0 the CRC32C of its own bytes in each copied part (``piece_crcs``), rank 0 combines them
with the fixed bytes' into the part's expected CRC32C (``expected_crc``), issues the copy and checks the store's
CRC32C of the copied part against it (``S3Parts.copy``). A copy that differs, or whose source is gone, is sent
instead, like every sent part by the rank holding most of its record bytes (the rule of ``partplan.part_plan``),
which receives the rest. So a missing, stale or forged sidecar costs bytes, never a wrong object.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import xxhash

import crc32c as _crc32c

from .partplan import Part
from ..format.checksum import combine
from ..format.objectdedup import plan_object
from ..format.rootrecords import source_records
from ..format.torchrecords import tiling

__all__ = ["Copy", "HashPart", "Piece", "expected_crc", "owned", "piece_crcs", "plan_shared", "staged_hashes"]

Copy = tuple[str, int]  # (source object, offset in it) of a copied part
Piece = tuple[int, int, int]  # (offset in the object, length, CRC32C) of bytes of a copied part


@dataclass
class HashPart:
    """One rank's record hashes (table index -> xxh3-128 hex), gathered by rank 0 with its CRC-32s."""

    hashes: dict[int, str] = field(default_factory=dict)


def staged_hashes(views: dict[int, memoryview]) -> HashPart:
    """This rank's staged records' content hashes (what ``torchrecords.hash_staged`` gives a single writer)."""
    return HashPart({i: xxhash.xxh3_128_hexdigest(v) for i, v in views.items() if len(v)})


def plan_shared(storage: Any, fmt: Any, fixed: list[tuple[int, bytes]], hashed: dict[int, str],
                size: int) -> tuple[list[tuple[Any, ...]] | None, list[Any] | None]:
    """Rank 0: (the part plan as plain tuples, or None when nothing can be copied; the new file's records for its
    sidecar, or None when a record was not hashed)."""
    records = tiling(fmt, fixed, hashed, size)
    if not records:
        return None, None
    plan = plan_object(size, records, source_records(storage, fmt.path))
    return (None if plan is None else [tuple(p) for p in plan]), records


def owned(plan: Sequence[Sequence[Any]], records: Sequence[tuple[int, int, int]]) -> tuple[list[Part], dict[int, Copy]]:
    """Every rank alike: the dedup plan's parts numbered from 1, each owned by the rank holding most of its record
    bytes (rank 0 where it holds none), and the copy source of each copied part, by number."""
    parts: list[Part] = []
    copies: dict[int, Copy] = {}
    for number, (kind, offset, length, source, source_offset) in enumerate(plan, 1):
        end = offset + length
        held: dict[int, int] = {}
        for off, nbytes, writer in records:
            overlap = min(end, off + nbytes) - max(offset, off)
            if overlap > 0:
                held[writer] = held.get(writer, 0) + overlap
        owner = min(held, key=lambda r: (-held[r], r)) if held else 0
        parts.append(Part(number, offset, end, owner))
        if kind == "copy":
            copies[number] = (str(source), int(source_offset))
    return parts, copies


def piece_crcs(parts: Sequence[Part], copies: dict[int, Copy], records: Sequence[tuple[int, int, int]],
               views: dict[int, memoryview], me: int) -> list[Piece]:
    """Every rank: the CRC32C of each of its own records' bytes in each copied part."""
    out: list[Piece] = []
    for p in parts:
        if p.number not in copies:
            continue
        for i, (off, nbytes, writer) in enumerate(records):
            lo, hi = max(off, p.start), min(off + nbytes, p.end)
            if writer == me and lo < hi:
                out.append((lo, hi - lo, _crc32c.crc32c(views[i][lo - off:hi - off])))
    return out


def expected_crc(part: Part, pieces: Sequence[Piece], fixed: Sequence[tuple[int, bytes]]) -> int | None:
    """Rank 0: the CRC32C of the local bytes of ``part``, from the ranks' pieces and the fixed bytes; None when
    they do not tile it exactly (then the part is sent, never copied unchecked)."""
    mine = [pc for pc in pieces if part.start <= pc[0] and pc[0] + pc[1] <= part.end]
    for off, gap in fixed:
        lo, hi = max(off, part.start), min(off + len(gap), part.end)
        if lo < hi:
            mine.append((lo, hi - lo, _crc32c.crc32c(gap[lo - off:hi - off])))
    crc, at = 0, part.start
    for off, length, piece in sorted(mine):
        if off != at:
            return None
        crc, at = combine(crc, piece, length), at + length
    return crc if at == part.end else None
