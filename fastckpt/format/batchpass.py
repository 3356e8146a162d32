"""The batched pass: a staged shard's checksums and health statistics in a few large native calls.

The training thread that launches a GPU's kernels needs the GIL all the time, and each time a background thread
takes it back after a native call, the training thread waits: for the hand-over and for whatever Python the
background runs before its next native call. The blocked pass (format/healthpass.py) made several torch calls per
128 KiB block: about 90,000 GIL hand-overs for a 1.48 GB checkpoint, a launch-bound training thread lost 478 ms a
checkpoint to them. Here a shard is cut into *pieces* of ``PIECE`` bytes and each piece costs a handful of calls
whatever the tensors in it: the copy of its tensors (one ``torch._foreach_copy_``, or one ``memmove`` per part of a
tensor larger than a piece), one checksum call per tensor part, then three reductions over the piece's whole groups
of ``GROUP`` values (their max, their min, their float32 norms: the blocked pass's statistics, group for group).
A piece whose groups all belong to one tensor (a large tensor's middle) takes its extremes in one ``aminmax`` over
all its values instead: one pass and one call, not two (W1: 98 of 243 pieces; the same extremes, exactly).
After the last piece, one segmented reduction per statistic gives each tensor's extremes and sum of squares.

The piece's size trades the two costs: in smaller pieces the copy's bytes are still in cache when the checksum
and the reductions read them, in larger ones a checkpoint makes fewer calls. W1 (1.48 GB, 580 tensors; 2-core AMD
EPYC, 32 MiB L3, one pass with health, 2026-12-07): 0.28, 0.30, 0.34 and 0.40 CPU-s per GB in pieces of 4, 8, 16
and 32 MiB, and about 1,750 against 700 hand-overs of the copy thread for 8 against 32 MiB. A hand-over costs the
training thread the background's Python up to its next native call, tens of microseconds here, so ``PIECE`` is
8 MiB: 0.1 CPU-s a checkpoint saved for a few tens of milliseconds of hand-overs at most.

A dtype *stretch* is a run of tensors of one float dtype laid back to back (format/plan.py lays a shard's widest
dtypes first, without holes), and its groups are counted from the stretch's start, so a group may straddle two
tensors: such groups belong to nobody. Each tensor's own head and tail (its values before its first and after its
last whole group: fewer than ``GROUP`` each) and tensors of less than a group are measured together, in float64,
with two ``torch._foreach_norm`` calls per shard. Tensors of other dtypes (integers, bool, complex, float8) and the
rare tensor with a NaN, an Inf or squares beyond float32 go through the blocked pass, value for value as before:
the statistics are format/health.py's whichever path measured them (``l2`` within 1e-6 relative, the rest exact).

The reductions of a piece run on the calling thread alone only if that thread is serial (engine/serialops.py):
callers use this pass where ``is_serial()`` holds and the blocked pass elsewhere. A shard's layout (its pieces and
views) depends only on the buffer and the shard, so callers keep it (``Layout.of``) from one checkpoint to the next.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import crc32c as _crc32c
import torch

from .checksum import crc32c
from .healthpass import GROUP, fingerprints, tensor_pass

__all__ = ["Layout", "Part", "Piece", "PIECE", "RELEASE", "NATIVE", "run", "measure", "records"]

NATIVE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)  # measured in groups without conversion
PIECE = 8 << 20  # bytes a piece's calls cover (see the module docstring)
RELEASE = 1 << 20  # a checksum call over fewer bytes keeps the GIL: a hand-over costs more than the bytes
_SIZE = {d: d.itemsize for d in NATIVE}

Checksum = Callable[[Any, int], int]  # continues a checksum over more bytes: crc32c, zlib's crc32
Fill = Callable[[Sequence["Part"]], None]  # copies a piece's parts into the staged buffer


@dataclass(slots=True)
class Part:
    """Bytes ``at..at+n`` of entry ``pos`` (its position in the shard), all of it when ``whole``."""

    pos: int
    at: int
    n: int
    whole: bool
    last: bool  # the entry's last part: its copy and checksum end here


@dataclass(slots=True)
class Piece:
    """A run of a shard's bytes: the parts it holds and, in a stretch, its whole groups and where their statistics
    go (rows of the stretch's arrays)."""

    parts: list[Part]
    grouped: torch.Tensor | None = None  # (rows, GROUP) view of the staged values
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (max, min, norm) of each row
    # where every row belongs to one entry: the piece's values flat and (min, max) of them all, taken in one
    # ``aminmax`` (its rows' max and min stay -inf and +inf: the segment reductions pass over them)
    flat: torch.Tensor | None = None
    extremes: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class _Stretch:
    """The statistics arrays of one dtype stretch, and which segment of rows belongs to which entry."""

    gmax: torch.Tensor
    gmin: torch.Tensor
    gnorm: torch.Tensor
    gsq: torch.Tensor  # float64 squares of the norms (scratch)
    lengths: torch.Tensor
    owners: list[int | None]  # entry position of each segment; None: rows that straddle two entries
    pmin: torch.Tensor | None = None  # the extremes of each piece whose rows are all one entry's...
    pmax: torch.Tensor | None = None
    powners: list[int] = field(default_factory=list)  # ...and that entry's position


@dataclass(eq=False)
class Layout:
    """A shard's pieces over one staged buffer: views made once, reused by every later checkpoint."""

    buf: torch.Tensor  # the staged buffer (flat uint8)
    entries: list[Any]  # the shard's TensorEntry list (positions index it)
    dtypes: list[torch.dtype]  # each entry's value dtype
    views: list[torch.Tensor]  # each entry's staged bytes with its dtype and shape (the copy's destination)
    pieces: list[Piece] = field(default_factory=list)
    stretches: list[_Stretch] = field(default_factory=list)
    smalls: list[torch.Tensor] = field(default_factory=list)  # values measured together (heads, tails, tiny)
    small_of: list[int] = field(default_factory=list)  # their entry positions
    small_lengths: torch.Tensor | None = None  # values of each small
    small_vals: torch.Tensor | None = None  # float64 scratch: every small's values, back to back
    small_sq: torch.Tensor | None = None  # float64 scratch: their squares
    others: list[int] = field(default_factory=list)  # entries the blocked pass measures
    grouped: list[bool] = field(default_factory=list)  # per entry: measured by the stretches and smalls
    wholes: list[Part] = field(default_factory=list)  # every entry whole: a plain copy's parts
    fused: Any = None  # format/fused.py's plan of this layout (False: a shard it does not cover), made once

    @classmethod
    def of(cls, buf: torch.Tensor, entries: Sequence[Any], dtypes: Sequence[torch.dtype]) -> "Layout":
        """Build the layout of ``entries`` (TensorEntry: ``offset``, ``nbytes``, ``shape``) staged in ``buf`` (flat
        uint8), their values of ``dtypes``. Positions are indices into ``entries``; pieces follow the buffer."""
        lay = cls(buf=buf, entries=list(entries), dtypes=list(dtypes), views=[])
        lay.views = [_typed(buf, e, dt) for e, dt in zip(lay.entries, lay.dtypes)]
        lay.grouped = [_native(e, dt) for e, dt in zip(lay.entries, lay.dtypes)]
        lay.wholes = [Part(pos, 0, e.nbytes, True, True) for pos, e in enumerate(lay.entries)]
        order = sorted(range(len(lay.entries)), key=lambda i: lay.entries[i].offset)
        k = 0
        while k < len(order):
            pos = order[k]
            if not lay.grouped[pos]:
                lay.others.append(pos)
                lay.pieces.append(Piece([Part(pos, 0, lay.entries[pos].nbytes, True, True)]))
                k += 1
                continue
            end = k + 1
            while end < len(order) and lay._joins(order[end - 1], order[end]):
                end += 1
            lay._stretch(buf, order[k:end])
            k = end
        if lay.smalls:
            count = sum(v.numel() for v in lay.smalls)
            lay.small_lengths = torch.tensor([v.numel() for v in lay.smalls])
            lay.small_vals = torch.empty(count, dtype=torch.float64)
            lay.small_sq = torch.empty(count, dtype=torch.float64)
        return lay

    def _joins(self, prev: int, pos: int) -> bool:
        """Whether entry ``pos`` continues the stretch that entry ``prev`` ends: same float dtype, no gap."""
        before = self.entries[prev]
        return (self.grouped[pos] and self.dtypes[pos] == self.dtypes[prev]
                and self.entries[pos].offset == before.offset + before.nbytes)

    def _stretch(self, buf: torch.Tensor, members: list[int]) -> None:
        dtype = self.dtypes[members[0]]
        gbytes = GROUP * _SIZE[dtype]
        start = self.entries[members[0]].offset
        stop = self.entries[members[-1]].offset + self.entries[members[-1]].nbytes
        rows = (stop - start) // gbytes
        norm_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        gmax, gmin = torch.empty(rows, dtype=dtype), torch.empty(rows, dtype=dtype)
        gnorm = torch.empty(rows, dtype=norm_dtype)
        grouped = buf[start:start + rows * gbytes].view(dtype).view(rows, GROUP) if rows else None
        lengths: list[int] = []
        owners: list[int | None] = []
        cursor = 0
        for pos in members:
            e = self.entries[pos]
            first = -(-(e.offset - start) // gbytes)
            last = (e.offset + e.nbytes - start) // gbytes
            if last <= first:  # no whole group of its own: measured by foreach, whole
                self._small(buf, pos, e.offset, e.nbytes)
                continue
            if first > cursor:
                lengths.append(first - cursor)
                owners.append(None)
            lengths.append(last - first)
            owners.append(pos)
            cursor = last
            self._small(buf, pos, e.offset, start + first * gbytes - e.offset)  # head
            self._small(buf, pos, start + last * gbytes, e.offset + e.nbytes - start - last * gbytes)  # tail
        if rows > cursor:
            lengths.append(rows - cursor)
            owners.append(None)
        stretch = _Stretch(gmax, gmin, gnorm, torch.empty(rows, dtype=torch.float64), torch.tensor(lengths), owners)
        spans = _spans(lengths, owners)
        pieces: list[Piece] = []
        for lo, hi in _cuts([(self.entries[p].offset, self.entries[p].nbytes) for p in members], start, gbytes):
            piece = Piece(self._parts(members, lo, hi))
            # the rows that end in this piece: a row straddling ``lo`` is whole once this piece's copy has run
            r0, r1 = (lo - start) // gbytes, (hi - start) // gbytes
            if r1 > r0 and grouped is not None:
                piece.grouped = grouped[r0:r1]
                piece.outs = (gmax[r0:r1], gmin[r0:r1], gnorm[r0:r1])
                owner = next((o for a, b, o in spans if a <= r0 and r1 <= b), None)
                if owner is not None:  # one entry's rows alone: one aminmax over them, not a max and a min per row
                    piece.flat = piece.grouped.view(-1)
                    stretch.powners.append(owner)
                    gmax[r0:r1] = -math.inf
                    gmin[r0:r1] = math.inf
            pieces.append(piece)
            self.pieces.append(piece)
        if stretch.powners:
            stretch.pmin = torch.empty(len(stretch.powners), dtype=dtype)
            stretch.pmax = torch.empty(len(stretch.powners), dtype=dtype)
            whole = iter(range(len(stretch.powners)))
            for piece in pieces:
                if piece.flat is not None:
                    j = next(whole)
                    piece.extremes = (stretch.pmin[j], stretch.pmax[j])
        if rows:
            self.stretches.append(stretch)

    def _parts(self, members: list[int], lo: int, hi: int) -> list[Part]:
        parts = []
        for pos in members:
            e = self.entries[pos]
            a, b = max(lo, e.offset), min(hi, e.offset + e.nbytes)
            if b > a:
                parts.append(Part(pos, a - e.offset, b - a, b - a == e.nbytes, b == e.offset + e.nbytes))
        return parts

    def _small(self, buf: torch.Tensor, pos: int, at: int, n: int) -> None:
        if n > 0:
            self.smalls.append(buf[at:at + n].view(self.dtypes[pos]))
            self.small_of.append(pos)


def _spans(lengths: list[int], owners: list[int | None]) -> list[tuple[int, int, int | None]]:
    """The rows ``[a, b)`` of each segment of a stretch, with its owner."""
    out = []
    at = 0
    for n, owner in zip(lengths, owners):
        out.append((at, at + n, owner))
        at += n
    return out


def _cuts(spans: list[tuple[int, int]], start: int, gbytes: int) -> list[tuple[int, int]]:
    """A stretch's pieces as byte ranges: whole tensors gathered up to ``PIECE`` bytes (a tensor is copied and
    checksummed in one call), a tensor larger than a piece cut at group boundaries (``gbytes`` from ``start``)."""
    cuts: list[tuple[int, int]] = []
    lo = start
    for at, n in spans:
        end = at + n
        if end - lo <= PIECE:
            continue
        if at > lo:  # close the piece before this tensor
            cuts.append((lo, at))
            lo = at
        while end - lo > PIECE:  # then cut it: each cut on the group grid, at least one group on
            cut = max(lo + gbytes, start + (lo + PIECE - start) // gbytes * gbytes)
            if cut >= end:
                break
            cuts.append((lo, cut))
            lo = cut
    cuts.append((lo, spans[-1][0] + spans[-1][1]))
    return cuts


def _native(e: Any, dtype: torch.dtype) -> bool:
    """Whether entry ``e`` is measured by groups: a float dtype the reductions take as is, at its alignment."""
    size = _SIZE.get(dtype)
    return size is not None and e.nbytes > 0 and e.nbytes % size == 0 and e.offset % size == 0


def _typed(buf: torch.Tensor, e: Any, dtype: torch.dtype) -> torch.Tensor:
    """Entry ``e``'s staged bytes, with ``dtype`` and its shape where they divide evenly (else flat bytes)."""
    raw = buf[e.offset:e.offset + e.nbytes]
    if e.nbytes == 0 or dtype.itemsize == 0 or e.nbytes % dtype.itemsize or e.offset % dtype.itemsize:
        return raw
    typed = raw.view(dtype)
    return typed.view(e.shape) if math.prod(e.shape) == typed.numel() else typed


def checksum_call(checksum: Checksum | None) -> Checksum | None:
    """``checksum`` as the pass calls it: CRC32C keeps the GIL below ``RELEASE`` bytes (its package would let it
    go from 32 KiB)."""
    if checksum is None:
        return None
    if checksum is crc32c:  # fastckpt's own (format/checksum.py); any other function is called as it is
        def crc(data: Any, value: int) -> int:
            return _crc32c.crc32c(data, value, gil_release_mode=1 if len(data) >= RELEASE else 0)
        return crc
    return checksum


def run(lay: Layout, buf: torch.Tensor, *, checksum: Checksum | None, health: bool, fill: Fill | None = None,
        check: Callable[[int], None] | None = None) -> tuple[list[int], dict[int, dict[str, Any]]]:
    """One pass over a shard: ``fill`` copies each piece's parts first (the copy thread), ``check(entry.index)``
    runs before an entry's first part is copied and after its last (the mutation guard); then the checksum of
    every part and, with ``health``, the piece's reductions. Returns each entry's checksum (in ``lay.entries``
    order; 0 without ``checksum``) and, with ``health``, each entry's statistics by position."""
    mv = memoryview(buf.numpy())
    crc = checksum_call(checksum)
    crcs = [0] * len(lay.entries)
    for piece in lay.pieces:
        if fill is not None:
            if check is not None:
                for p in piece.parts:
                    if p.at == 0:
                        check(lay.entries[p.pos].index)
            fill(piece.parts)
        if crc is not None:
            for p in piece.parts:
                at = lay.entries[p.pos].offset + p.at
                crcs[p.pos] = crc(mv[at:at + p.n], crcs[p.pos])
        if health and piece.grouped is not None:
            gmax, gmin, gnorm = piece.outs  # type: ignore[misc]
            if piece.extremes is not None:
                torch.aminmax(piece.flat, out=piece.extremes)  # type: ignore[arg-type]
            else:
                torch.amax(piece.grouped, dim=1, out=gmax)
                torch.amin(piece.grouped, dim=1, out=gmin)
            torch.linalg.vector_norm(piece.grouped, 2, dim=1, dtype=gnorm.dtype, out=gnorm)
        if fill is not None and check is not None:
            for p in piece.parts:
                if p.last:
                    check(lay.entries[p.pos].index)
    if crc is not None:
        crcs = [c & 0xFFFFFFFF for c in crcs]
    return crcs, (measure(lay, mv) if health else {})


def _collect(lay: Layout, owners: Sequence[int | None], top: list[float], bottom: list[float], sq: list[float],
             absmax: list[float], squares: list[float]) -> None:
    """Fold segment ``k``'s max, min and sum of squares into the statistics of its entry ``owners[k]``."""
    for k, pos in enumerate(owners):
        if pos is not None:
            absmax[pos] = max(absmax[pos], -bottom[k], top[k])
            squares[pos] += sq[k]


def measure(lay: Layout, mv: memoryview) -> dict[int, dict[str, Any]]:
    """Each entry's statistics (by position) from the pieces' reductions, once every piece of the shard ran."""
    absmax = [0.0] * len(lay.entries)
    squares = [0.0] * len(lay.entries)
    for s in lay.stretches:  # a NaN propagates through all three; an Inf at least through the squares
        torch.square(s.gnorm, out=s.gsq)
        _collect(lay, s.owners, torch.segment_reduce(s.gmax, "max", lengths=s.lengths).tolist(),
                 torch.segment_reduce(s.gmin, "min", lengths=s.lengths).tolist(),
                 torch.segment_reduce(s.gsq, "sum", lengths=s.lengths).tolist(), absmax, squares)
        if s.pmax is not None and s.pmin is not None:  # the pieces of one entry's rows alone
            _collect(lay, s.powners, s.pmax.tolist(), s.pmin.tolist(), [0.0] * len(s.powners), absmax, squares)
    if lay.smalls:  # every small's values in one float64 scratch, then the same segmented reductions
        vals, sq = lay.small_vals, lay.small_sq
        torch.cat(lay.smalls, out=vals)
        torch.square(vals, out=sq)
        _collect(lay, lay.small_of, torch.segment_reduce(vals, "max", lengths=lay.small_lengths).tolist(),
                 torch.segment_reduce(vals, "min", lengths=lay.small_lengths).tolist(),
                 torch.segment_reduce(sq, "sum", lengths=lay.small_lengths).tolist(), absmax, squares)
    return records(lay, mv, {pos: (absmax[pos], squares[pos]) for pos in range(len(lay.entries))
                             if lay.grouped[pos] and math.isfinite(squares[pos]) and math.isfinite(absmax[pos])})


def records(lay: Layout, mv: memoryview, found: dict[int, tuple[float, float]]) -> dict[int, dict[str, Any]]:
    """Each entry's statistics (by position) from the ``(absmax, sum of squares)`` a pass found for the finite
    entries of its dtypes (``found``), with their fingerprints; every other entry (another dtype, or a NaN, an Inf
    or an overflow somewhere in it: rare) measured by the blocked pass, exactly. Also format/fused.py's."""
    out: dict[int, dict[str, Any]] = {}
    fps = fingerprints(mv, [(lay.entries[pos].offset, lay.entries[pos].nbytes) for pos in found])
    for (pos, (absmax, squares)), fp in zip(found.items(), fps):
        e = lay.entries[pos]
        out[pos] = {"n": e.nbytes // lay.dtypes[pos].itemsize, "nan": 0, "inf": 0, "absmax": absmax,
                    "l2": math.sqrt(squares), "fp": fp}
    for pos, e in enumerate(lay.entries):
        if pos not in out:
            out[pos] = tensor_pass(lay.buf[e.offset:e.offset + e.nbytes], lay.dtypes[pos])[0]
    return dict(sorted(out.items()))
