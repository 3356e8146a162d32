"""Dedup part plans: which byte ranges of a new object are sent, and which are copied server-side from an old one.

A pure function of data: the new object's size and its records ``(offset, length, content hash)``, and the
records of a previous object (``(source key, offset, length, hash)``, any offsets: a record that moved, because
the header before it grew, is found by its hash and copied from its OLD range). The plan is a list of parts in
object order, each either sent from the local bytes or copied from a range of a previous object (S3's
``UploadPartCopy``). S3's rules hold: every part but the last is at least ``MIN_PART`` bytes, at most 10,000
parts, a copied range at most 5 GiB. A copy run shorter than a part is sent instead, and a sent region shorter
than a part borrows the bytes it lacks from the copy run after it (or before it, at the end), so each changed
region costs at most one part of slack beyond its own bytes. Nothing here reads bytes or talks to a store; the
uploader (``s3copy.py``) executes the plan, and multi-rank uploads can split the same plan between ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Sequence

from ..errors import IntegrityError

__all__ = ["COPY_PART", "MAX_PARTS", "MIN_PART", "Part", "Record", "SourceRecord", "plan_parts", "plan_stats"]

MIN_PART = 5 * 1024 * 1024  # S3's smallest part (all but the last)
SEND_PART = 16 * 1024 * 1024  # a sent run is cut in parts of about this size (s3checksum.PART_BYTES)
COPY_PART = 512 * 1024 * 1024  # a copied run is cut in parts of at most this: server-side, so large is cheap
_MAX_COPY = 5 * 1024 ** 3  # S3's largest UploadPartCopy range
MAX_PARTS = 10_000  # S3's most parts in one upload


class Record(NamedTuple):
    """A byte range of the new object and the content hash of its bytes."""

    offset: int
    length: int
    digest: str


class SourceRecord(NamedTuple):
    """A byte range of a previous, committed object, with the content hash its writer recorded."""

    key: str
    offset: int
    length: int
    digest: str


class Part(NamedTuple):
    """One part of the plan. ``kind`` is ``"send"`` (bytes ``[offset, offset+length)`` of the new object go up)
    or ``"copy"`` (those bytes are ``[source_offset, source_offset+length)`` of the object ``source``)."""

    kind: str
    offset: int
    length: int
    source: str | None = None
    source_offset: int = 0


@dataclass
class _Run:
    offset: int
    length: int
    source: str | None = None  # None: sent
    source_offset: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length


def plan_parts(size: int, records: Iterable[Record], previous: Iterable[SourceRecord], *,
               min_part: int = MIN_PART, send_part: int = SEND_PART, copy_part: int = COPY_PART) -> list[Part]:
    """The parts of a ``size``-byte object: ranges whose record hash (and length) a previous object holds are
    copied from there, the rest (changed records, bytes no record covers) are sent. Raises ``IntegrityError`` on
    records that overlap or leave the object (a corrupt manifest): never a plan that builds wrong bytes."""
    if not 0 < min_part <= send_part or copy_part > _MAX_COPY or copy_part < min_part:
        raise ValueError(f"part sizes out of range: min {min_part}, send {send_part}, copy {copy_part}")
    index: dict[tuple[str, int], SourceRecord] = {}
    holders: set[tuple[str, int, str, int]] = set()
    for src in previous:
        index.setdefault((src.digest, src.length), src)
        holders.add((src.key, src.offset, src.digest, src.length))
    runs = _merge(_segments(size, records, index, holders))
    runs = _merge([r if r.source is None or r.length >= min_part else _Run(r.offset, r.length) for r in runs])
    runs = _borrow(runs, min_part)
    parts: list[Part] = []
    for r in runs:
        parts.extend(_split(r, send_part if r.source is None else copy_part, min_part))
    if len(parts) > MAX_PARTS:  # only for a huge object cut very finely: plain parts of the right size
        each = -(-size // MAX_PARTS)
        return [Part("send", o, min(each, size - o)) for o in range(0, size, each)]
    return parts


def plan_stats(parts: Sequence[Part]) -> tuple[int, int]:
    """(bytes sent, bytes copied) of a plan."""
    sent = sum(p.length for p in parts if p.kind == "send")
    return sent, sum(p.length for p in parts) - sent


def _segments(size: int, records: Iterable[Record], index: Mapping[tuple[str, int], SourceRecord],
              holders: set[tuple[str, int, str, int]]) -> list[_Run]:
    """The object cut at record edges: each record copied when a previous object has its bytes, else sent; the
    bytes between records (none in fastckpt's own records, which tile the file) are sent. Equal records are
    common (every LayerNorm's ones and zeros): the copy of the one right after the previous copy's source range
    is preferred, so that runs stay long; else the first holder of those bytes."""
    out: list[_Run] = []
    at = 0
    for rec in sorted(records, key=lambda r: r.offset):
        if rec.offset < at or rec.length < 0 or rec.offset + rec.length > size:
            raise IntegrityError(f"content records overlap or leave the {size}-byte object at record {tuple(rec)}: "
                                 "the manifest is corrupt; the file is uploaded whole")
        if rec.offset > at:
            out.append(_Run(at, rec.offset - at))
        src = index.get((rec.digest, rec.length))
        last = out[-1] if out else None
        if src is not None and last is not None and last.source is not None and last.end == rec.offset and (
                (last.source, last.source_offset + last.length, rec.digest, rec.length) in holders):
            src = SourceRecord(last.source, last.source_offset + last.length, rec.length, rec.digest)
        out.append(_Run(rec.offset, rec.length, src.key if src else None, src.offset if src else 0))
        at = rec.offset + rec.length
    if at < size:
        out.append(_Run(at, size - at))
    return [r for r in out if r.length]


def _merge(runs: list[_Run]) -> list[_Run]:
    """Adjacent sent runs join; adjacent copied runs join when their sources are adjacent in the same object."""
    out: list[_Run] = []
    for r in runs:
        last = out[-1] if out else None
        if last is not None and last.source == r.source and (
                r.source is None or last.source_offset + last.length == r.source_offset):
            last.length += r.length
        else:
            out.append(_Run(r.offset, r.length, r.source, r.source_offset))
    return out


def _borrow(runs: list[_Run], min_part: int) -> list[_Run]:
    """Every sent run but the last grows to ``min_part`` by taking bytes from the start of the copy run after it;
    a copy run that shrinks below ``min_part`` is sent whole. At the end, a short sent run after a copy run may
    stay short (the last part), so nothing is borrowed there."""
    out: list[_Run] = []
    todo = list(runs)
    while todo:
        r = todo.pop(0)
        if r.source is None and todo and todo[0].source is None:  # a copy run was sent instead: join, look again
            todo.insert(0, _Run(r.offset, r.length + todo.pop(0).length))
            continue
        if r.source is None and r.length < min_part and todo:
            nxt = todo[0]  # a copy run
            need = min_part - r.length
            if nxt.length - need >= min_part or (len(todo) == 1 and nxt.length > need):
                r = _Run(r.offset, min_part)
                todo[0] = _Run(nxt.offset + need, nxt.length - need, nxt.source, nxt.source_offset + need)
            else:  # too short to stay a copy: sent with this run, which is looked at again
                todo[0] = _Run(r.offset, r.length + todo[0].length)
                continue
        out.append(r)
    return out


def _split(r: _Run, size: int, min_part: int) -> list[Part]:
    """A run cut in near-equal parts of about ``size`` bytes, never one under ``min_part`` (but a short run)."""
    n = max(1, min(-(-r.length // size), r.length // min_part))
    step = -(-r.length // n)
    out = []
    for o in range(0, r.length, step):
        n_bytes = min(step, r.length - o)
        if r.source is None:
            out.append(Part("send", r.offset + o, n_bytes))
        else:
            out.append(Part("copy", r.offset + o, n_bytes, r.source, r.source_offset + o))
    return out
