"""The parts of one S3 object uploaded by several ranks: computed alike on every rank from rank 0's layout.

S3 takes parts of any size from 5 MiB (``MIN_PART``) up, except the last, and at most 10,000 of them. The file is
a run of records, each staged by one rank (its writer), with the small fixed bytes (pickle, zip headers, central
directory) between them, which rank 0 builds after the CRC gather and every rank then receives. So the fixed bytes
belong to no rank in particular: each joins the record run before it (the leading ones the first run).

The cut, greedy and deterministic: a run of one owner of at least ``MIN_PART`` is its own part (or several, at most
``max_part`` each); a short run joins the part before it, or, where that part is itself still short, the part takes
from the next run just what it lacks. A part is uploaded by the rank that holds most of its record bytes; the other
records' bytes in it (a short run, or the piece taken to fill a part) go to that rank point to point: at most one
part's worth per boundary between owners. ``Coordinator.assign_file(..., contiguous=True)`` gives each rank one
stretch of the file, so boundaries are few.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..storage.partplan import MAX_PARTS, MIN_PART

__all__ = ["MIN_PART", "Fragment", "Part", "contiguous_owners", "fragments", "limits", "part_plan"]

_MIB = 1 << 20


@dataclass(frozen=True)
class Part:
    """Part ``number`` (from 1): bytes ``[start, end)`` of the object, uploaded by rank ``owner``."""

    number: int
    start: int
    end: int
    owner: int


@dataclass(frozen=True)
class Fragment:
    """Bytes ``[lo, hi)`` of record ``record`` (relative to the record), sent by rank ``src`` to rank ``dst``."""

    part: int
    record: int
    lo: int
    hi: int
    src: int
    dst: int


def limits(size: int, target: int) -> tuple[int, int]:
    """(smallest part but the last, largest part) of a ``size``-byte object: parts of at least ``MIN_PART``, and
    large enough that 10,000 parts hold it; the largest twice the smallest at least, so that a long run cut in
    equal pieces never leaves one short. ``target``: the single-writer part size (``s3checksum.part_bytes``)."""
    per = -(-size // (MAX_PARTS - 1))  # every part but the last at least this: 10,000 parts at most
    least = max(MIN_PART, -(-per // _MIB) * _MIB)
    return least, max(target, 2 * least)


def _runs(size: int, records: Sequence[tuple[int, int, int]], min_part: int) -> list[list[int]]:
    """[start, end, owner] runs covering ``[0, size)``: records of one writer, the fixed bytes joined to the run
    before them (the leading ones to the first run; rank 0's where there is no record). A short run between two
    runs of one owner (a buffer only rank 0 writes, amid another rank's stretch) is taken into them: its bytes
    move, under one part, rather than cut that stretch in two."""
    runs: list[list[int]] = []
    cursor = 0
    for off, n, owner in sorted(r for r in records if r[1] > 0):
        if not runs:
            runs.append([0, off + n, owner])
        elif runs[-1][2] == owner:
            runs[-1][1] = off + n
        else:
            runs[-1][1] = off  # the fixed bytes before this record: the previous run's
            runs.append([off, off + n, owner])
        cursor = off + n
    if not runs:
        return [[0, size, 0]] if size else []
    runs[-1][1] = max(cursor, size)
    merged: list[list[int]] = []
    for run in runs:
        merged.append(run)
        while len(merged) >= 3 and merged[-3][2] == merged[-1][2]:
            first, middle, last = merged[-3:]
            short = middle[1] - middle[0]
            if short >= min_part or short > min(first[1] - first[0], last[1] - last[0]):
                break  # the middle one is a stretch of its own, or the smaller one to move is a neighbour
            merged[-3:] = [[first[0], last[1], first[2]]]
    return merged


def part_plan(size: int, records: Sequence[tuple[int, int, int]], min_part: int, max_part: int) -> list[Part]:
    """The parts of the object: ``records`` are (offset, nbytes, writer) of each record in the file."""
    runs = _runs(size, records, min_part)
    cuts: list[list[tuple[int, int, int]]] = []  # each part: (start, end, owner) pieces
    cur: list[tuple[int, int, int]] = []
    n = 0  # bytes in cur

    def close() -> None:
        nonlocal cur, n
        cuts.append(cur)
        cur, n = [], 0

    for s, e, o in runs:
        while s < e:
            left = e - s
            if n == 0:  # a fresh part from this run: all of it if it fits, else a piece that leaves a full part
                take = left if left <= max_part else min(max_part, left - min_part)
                cur.append((s, s + take, o))
                n, s = take, s + take
                if s < e:
                    close()
                continue
            if n < min_part:
                need = min_part - n
                if left - need >= min_part:  # take what the part lacks; the rest of the run stands alone
                    cur.append((s, s + need, o))
                    s += need
                    close()
                    continue
                cur.append((s, e, o))  # short: the part now holds < 2 * min_part <= max_part
                n, s = n + left, e
                continue
            if left < min_part and n + left <= max_part:  # a short run joins the part before it
                cur.append((s, e, o))
                n, s = n + left, e
                continue
            close()
    if cur:
        close()
    parts = []
    for i, pieces in enumerate(cuts):
        held: dict[int, int] = {}
        for s, e, o in pieces:
            held[o] = held.get(o, 0) + e - s
        owner = min(held, key=lambda r: (-held[r], r))
        parts.append(Part(i + 1, pieces[0][0], pieces[-1][1], owner))
    return parts


def fragments(parts: Sequence[Part], records: Sequence[tuple[int, int, int]]) -> list[Fragment]:
    """The record bytes each part's owner needs from other ranks, in one order on every rank (part, record)."""
    out: list[Fragment] = []
    order = sorted(range(len(records)), key=lambda i: records[i][0])
    for p in parts:
        for i in order:
            off, nbytes, writer = records[i]
            lo, hi = max(off, p.start), min(off + nbytes, p.end)
            if nbytes and lo < hi and writer != p.owner:
                out.append(Fragment(p.number, i, lo - off, hi - off, writer, p.owner))
    return out


def contiguous_owners(shards: Sequence[Any], world: int, group_rank: Callable[[int], int]) -> dict[int, int]:
    """The rank that stages each shard of a torch file uploaded as one object by ``world`` ranks: each rank one
    stretch of the file (by its shards' first records, in file order, split evenly by bytes), so that parts seldom
    mix owners. A shard with an owner (what only rank 0 may write) stays its owner's. Computed alike on every
    rank, with no communication."""
    owners: dict[int, int] = {s.index: group_rank(s.owner) for s in shards if s.owner >= 0}
    free = sorted((s for s in shards if s.owner < 0), key=lambda s: min((e.index for e in s.entries), default=0))
    total = sum(s.nbytes for s in free) or 1
    done = 0
    for s in free:
        owners[s.index] = min(world - 1, (done + s.nbytes // 2) * world // total)
        done += s.nbytes
    return owners
