"""The part plan of one S3 object uploaded by several ranks (``fastckpt.engine.partplan``): pure, computed alike on
every rank."""
from __future__ import annotations

import random

import pytest

from fastckpt.engine.partplan import MIN_PART, fragments, limits, part_plan

MIB = 1 << 20


def _check(size: int, records: list[tuple[int, int, int]]) -> list:
    least, most = limits(size, 16 * MIB)
    parts = part_plan(size, records, least, most)
    assert parts[0].start == 0 and parts[-1].end == size, "the parts cover the object"
    assert all(a.end == b.start for a, b in zip(parts, parts[1:])), "back to back, no overlap"
    assert all(p.end - p.start >= least for p in parts[:-1]), "every part but the last at least S3's minimum"
    assert all(p.end - p.start <= most for p in parts)
    assert [p.number for p in parts] == list(range(1, len(parts) + 1))
    for f in fragments(parts, records):  # what moves between ranks: never more than one part's worth
        assert f.src != f.dst and 0 < f.hi - f.lo <= most
    return parts


@pytest.mark.parametrize("seed", range(300))
def test_random_layouts_give_valid_parts(seed):
    rng = random.Random(seed)
    records, off = [], rng.randint(0, 5000)
    for _ in range(rng.randint(0, 30)):
        n = rng.choice([0, 10, 1000, rng.randint(1, 20 * MIB)])
        records.append((off, n, rng.randint(0, 3)))
        off += n + rng.randint(30, 200)
    _check(off + rng.randint(1, 3000), records)


def test_a_buffer_amid_another_ranks_stretch_keeps_one_part_per_rank():
    # Lightning's .ckpt on 4 ranks: each rank a ~6.3 MB stretch; a 128-byte record only rank 0 writes sits in rank
    # 1's. It moves to rank 1 rather than cut rank 1's stretch in two (whose halves joined rank 0's part before).
    mb = 1_048_576
    records = [(i * (mb + 2200), mb, i // 6) for i in range(24)]
    records.insert(8, (records[7][0] + mb + 64, 128, 0))
    records = [(off + (256 if i > 8 else 0), n, w) for i, (off, n, w) in enumerate(records)]
    size = records[-1][0] + mb + 5000
    parts = _check(size, records)
    assert [p.owner for p in parts] == [0, 1, 2, 3]
    moved = fragments(parts, records)
    assert [(f.src, f.dst, f.hi - f.lo) for f in moved] == [(0, 1, 128)]


def test_a_huge_object_stays_within_ten_thousand_parts():
    size = 200 << 30
    least, most = limits(size, 16 * MIB)
    assert least >= MIN_PART and most >= 2 * least
    assert len(part_plan(size, [(0, size, 0)], least, most)) <= 10_000
    assert len(part_plan(size, [(i * (size // 64), size // 64, i % 4) for i in range(64)], least, most)) <= 10_000
