"""The dedup part plan (fastckpt/storage/partplan.py): a pure function, checked by executing it on real bytes."""
from __future__ import annotations

import random

import pytest
import xxhash

from fastckpt.errors import IntegrityError
from fastckpt.storage.partplan import MIN_PART, Part, Record, SourceRecord, plan_parts, plan_stats

MiB = 1 << 20


def _records(data: bytes, cuts: list[int]) -> list[Record]:
    """Records tiling ``data`` at ``cuts`` (each with its xxh3-128), as a writer would record them."""
    edges = [0, *cuts, len(data)]
    return [Record(a, b - a, xxhash.xxh3_128_hexdigest(data[a:b])) for a, b in zip(edges, edges[1:]) if b > a]


def _execute(parts: list[Part], new: bytes, sources: dict[str, bytes]) -> bytes:
    """What the store ends up holding: sent parts from ``new``, copied parts from their source object."""
    out = bytearray()
    for p in parts:
        assert p.offset == len(out), "parts must be in order and contiguous"
        if p.kind == "send":
            out += new[p.offset: p.offset + p.length]
        else:
            out += sources[p.source][p.source_offset: p.source_offset + p.length]
    return bytes(out)


def _check_rules(parts: list[Part], size: int) -> None:
    assert sum(p.length for p in parts) == size
    for p in parts[:-1]:
        assert p.length >= MIN_PART, f"part {p} is under S3's 5 MiB minimum and not the last"
    assert all(p.length > 0 for p in parts)


def _pieces(sizes: list[int], seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(n) for n in sizes]


def test_unchanged_records_are_copied_from_their_old_shifted_offsets():
    """The header grew by 4 KiB, so every record moved: they are still found by hash, copied from the old range."""
    body = _pieces([8 * MiB, 7 * MiB, 9 * MiB], 1)
    old = b"H" * 4096 + b"".join(body)
    new = b"h" * 8192 + b"".join(body)
    prev = [SourceRecord("old", *r) for r in _records(old, [4096, 4096 + 8 * MiB, 4096 + 15 * MiB])]
    parts = plan_parts(len(new), _records(new, [8192, 8192 + 8 * MiB, 8192 + 15 * MiB]), prev)
    _check_rules(parts, len(new))
    assert _execute(parts, new, {"old": old}) == new
    sent, copied = plan_stats(parts)
    assert sent == MIN_PART  # the changed header plus the bytes borrowed to make its part 5 MiB
    assert copied == len(new) - MIN_PART
    assert parts[1].kind == "copy" and parts[1].source_offset == 4096 + (MIN_PART - 8192)


def test_changed_record_in_the_middle_costs_its_bytes_plus_at_most_one_part():
    body = _pieces([20 * MiB, 1 * MiB, 20 * MiB], 2)
    old = b"".join(body)
    new_body = [body[0], bytes(reversed(body[1])), body[2]]
    new = b"".join(new_body)
    cuts = [20 * MiB, 21 * MiB]
    parts = plan_parts(len(new), _records(new, cuts), [SourceRecord("o", *r) for r in _records(old, cuts)])
    _check_rules(parts, len(new))
    assert _execute(parts, new, {"o": old}) == new
    sent, _ = plan_stats(parts)
    assert 1 * MiB <= sent <= 1 * MiB + MIN_PART


def test_record_whose_size_changed_is_sent():
    a, b = _pieces([6 * MiB, 12 * MiB], 3)
    old = a + b
    new = a + b[: 10 * MiB]  # same prefix, shorter record: its hash differs, and so does its length
    parts = plan_parts(len(new), _records(new, [6 * MiB]), [SourceRecord("o", *r) for r in _records(old, [6 * MiB])])
    _check_rules(parts, len(new))
    assert _execute(parts, new, {"o": old}) == new
    assert parts == [Part("copy", 0, 6 * MiB, "o", 0), Part("send", 6 * MiB, 10 * MiB)]


def test_all_changed_sends_everything_in_plain_parts():
    old, new = _pieces([40 * MiB, 40 * MiB], 4)
    cuts = [10 * MiB, 20 * MiB, 30 * MiB]
    parts = plan_parts(len(new), _records(new, cuts), [SourceRecord("o", *r) for r in _records(old, cuts)])
    _check_rules(parts, len(new))
    assert all(p.kind == "send" for p in parts)
    assert _execute(parts, new, {"o": old}) == new


def test_nothing_changed_copies_everything_and_sends_nothing():
    (data,) = _pieces([30 * MiB + 123], 5)
    cuts = [7 * MiB, 19 * MiB]
    parts = plan_parts(len(data), _records(data, cuts), [SourceRecord("o", *r) for r in _records(data, cuts)])
    _check_rules(parts, len(data))
    assert plan_stats(parts) == (0, len(data))
    assert parts == [Part("copy", 0, len(data), "o", 0)]  # one run: the sources are adjacent in the same object


def test_short_unchanged_runs_between_changes_are_merged_into_sent_parts():
    """Unchanged records under 5 MiB cannot be their own part: sent with the changes around them."""
    sizes = [1 * MiB, 2 * MiB, 1 * MiB, 3 * MiB, 1 * MiB, 12 * MiB]
    old_p = _pieces(sizes, 6)
    new_p = list(old_p)
    for i in (0, 2, 4):  # records 1 and 3 (2 and 3 MiB) are unchanged but too short to copy
        new_p[i] = bytes(reversed(old_p[i]))
    old, new = b"".join(old_p), b"".join(new_p)
    cuts = [sum(sizes[:i]) for i in range(1, len(sizes))]
    parts = plan_parts(len(new), _records(new, cuts), [SourceRecord("o", *r) for r in _records(old, cuts)])
    _check_rules(parts, len(new))
    assert _execute(parts, new, {"o": old}) == new
    assert [p.kind for p in parts] == ["send", "copy"]
    assert parts[0].length == 8 * MiB  # the 8 MiB changed-and-short run is one part; the 12 MiB tail is copied


def test_last_part_may_be_small_and_a_short_tail_copy_is_sent():
    a, b, c = _pieces([10 * MiB, 2 * MiB, 1 * MiB], 7)
    old = a + b + c
    new = a + bytes(reversed(b)) + c  # unchanged 1 MiB tail: too short to copy, sent in the small last part
    cuts = [10 * MiB, 12 * MiB]
    parts = plan_parts(len(new), _records(new, cuts), [SourceRecord("o", *r) for r in _records(old, cuts)])
    _check_rules(parts, len(new))
    assert _execute(parts, new, {"o": old}) == new
    assert parts[-1].kind == "send" and parts[-1].length == 3 * MiB
    assert parts[0] == Part("copy", 0, 10 * MiB, "o", 0)


def test_records_from_several_old_objects_and_moved_order():
    a, b = _pieces([6 * MiB, 7 * MiB], 8)
    new = b + a  # b was in object "x", a in object "y", at other offsets
    prev = [SourceRecord("x", 100, len(b), xxhash.xxh3_128_hexdigest(b)),
            SourceRecord("y", 0, len(a), xxhash.xxh3_128_hexdigest(a))]
    parts = plan_parts(len(new), _records(new, [len(b)]), prev)
    _check_rules(parts, len(new))
    assert _execute(parts, new, {"x": b"\0" * 100 + b, "y": a}) == new
    assert [(p.kind, p.source) for p in parts] == [("copy", "x"), ("copy", "y")]


def test_random_plans_rebuild_the_new_object_exactly():
    rng = random.Random(9)
    for trial in range(30):
        sizes = [rng.choice([4096, 300_000, 2 * MiB, 6 * MiB]) for _ in range(rng.randint(1, 9))]
        old_p = _pieces(sizes, 100 + trial)
        new_p = [bytes(reversed(p)) if rng.random() < 0.4 else p for p in old_p]
        head_old, head_new = rng.randbytes(4096), rng.randbytes(rng.choice([4096, 8192]))
        old, new = head_old + b"".join(old_p), head_new + b"".join(new_p)
        oc = [len(head_old) + sum(sizes[:i]) for i in range(len(sizes))]
        nc = [len(head_new) + sum(sizes[:i]) for i in range(len(sizes))]
        parts = plan_parts(len(new), _records(new, nc), [SourceRecord("o", *r) for r in _records(old, oc)],
                           send_part=8 * MiB)
        _check_rules(parts, len(new))
        assert _execute(parts, new, {"o": old}) == new
        changed = len(head_new) + sum(len(n) for n, o in zip(new_p, old_p) if n != o)
        regions = 1 + sum(1 for i, (n, o) in enumerate(zip(new_p, old_p)) if n != o and (i == 0 or new_p[i - 1] == old_p[i - 1]))
        # each changed region: its bytes, plus at most one part of slack (borrowed, or a short run sent)
        assert plan_stats(parts)[0] <= changed + regions * MIN_PART + MIN_PART


def test_overlapping_records_are_refused():
    with pytest.raises(IntegrityError, match="overlap"):
        plan_parts(100, [Record(0, 60, "a"), Record(50, 50, "b")], [])
    with pytest.raises(IntegrityError, match="leave"):
        plan_parts(100, [Record(90, 20, "a")], [])


def test_equal_records_in_many_places_keep_runs_whole():
    """Every LayerNorm weight is all ones: equal records in many places. Each copy continues its own run, so an
    unchanged stretch stays one copy instead of breaking at every equal record (and being sent for shortness)."""
    ones = b"\x01" * 4096
    big = _pieces([6 * MiB, 6 * MiB, 6 * MiB], 10)
    old_p = [big[0], ones, big[1], ones, big[2], ones]
    new_p = list(old_p)
    new_p[0] = bytes(reversed(big[0]))  # only the first record changed
    old, new = b"".join(old_p), b"".join(new_p)
    cuts = [sum(len(p) for p in old_p[:i]) for i in range(1, len(old_p))]
    parts = plan_parts(len(new), _records(new, cuts), [SourceRecord("o", *r) for r in _records(old, cuts)])
    _check_rules(parts, len(new))
    assert _execute(parts, new, {"o": old}) == new
    assert [p.kind for p in parts] == ["send", "copy"] and plan_stats(parts)[0] == 6 * MiB
