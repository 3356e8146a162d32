"""Checking a torch file's records while it is still being read (the torch zip reader's cold path).

``fastckpt.read.torchzip`` reads a cold torch file on several threads into one buffer, then checks every record
against the CRC-32 of its zip entry. As a second pass that check followed the reads: 0.08 s of a 1.2 s cold load
of 1.48 GB on the benchmark VM, with the disk idle. Here the zip directory is read first (the file's last
``TAIL`` bytes hold it), and each record is checked by the reading thread whose piece completed it, while the other
threads go on reading: the check overlaps the reads.

Only what the directory says is used before the file is whole: a record's local header offset, size and CRC-32;
its data offset is parsed from its local header once those bytes have landed. ``torchzip`` then parses the whole
file as before (``record_spans``) and checks every record this did not check, byte range and CRC-32 alike, so a
file whose directory is damaged, crafted or unusual (zip64, records out of order, no CRC-32s) is checked exactly
as it was, only later; a mismatch found early raises the same ``IntegrityError``, naming the file and the record.
"""
from __future__ import annotations

import bisect
import struct
import threading

from ..errors import IntegrityError
from ..format.checksum import crc32
from ..format.zipdir import central_records, crc_less, data_offset


__all__ = ["TAIL", "EarlyCheck", "mismatch"]

TAIL = 1 << 20  # read first: the zip directory of a torch file of up to ~10,000 records
_PAGE = 4096
_LOCAL_HEADER = 30  # bytes before the name and the extra field


def mismatch(path: str, name: str, got: int, want: int, advice: str) -> IntegrityError:
    """The error of a record whose bytes do not match its zip entry's CRC-32 (torchzip's wording)."""
    return IntegrityError(f"{path}: record {name!r} has CRC-32 {got:08x}, its zip entry says {want:08x}; {advice}")


class _Tail:
    """``view.read`` over the bytes of the file that have landed, ``[start, size)``: anything else is refused."""

    def __init__(self, mv: memoryview, start: int) -> None:
        self.mv, self.start, self.size = mv, start, len(mv)

    def read(self, offset: int, n: int) -> bytes:
        if offset < self.start or offset + n > self.size:
            raise _Outside
        return bytes(self.mv[offset:offset + n])


class _Outside(Exception):
    """The directory points outside the tail: leave every record to the check after the read."""


class EarlyCheck:
    """The records of the file in ``view`` (whose ``[tail, len(view))`` has landed) checked as their bytes land.

    ``landed(start, n)`` is a ``Range.on_piece``: it marks the pages it completes and checks, on the calling
    thread, each record that is now whole. ``done`` then holds ``(data offset, size, CRC-32)`` of every record
    checked; a mismatch raises from ``landed`` (which fails the read). A directory that cannot be parsed from the
    tail, or a file written without CRC-32s, leaves ``active`` False: nothing is checked early."""

    def __init__(self, path: str, view: memoryview, tail: int, advice: str) -> None:
        self.path, self.view, self.advice = path, view, advice
        self.size = len(view)
        self.done: set[tuple[int, int, int]] = set()
        self._lock = threading.Lock()
        self._pages = bytearray((self.size + _PAGE - 1) // _PAGE)  # 1: the page has landed
        self._records: list[tuple[int, str, int, int]] = []  # (local header offset, name, size, CRC-32)
        try:
            records = list(central_records(_Tail(view, tail)))
        except (_Outside, IntegrityError, struct.error, ValueError, IndexError):
            records = []  # torchzip's own parse of the whole file reports what is wrong, naming the file
        if records and not crc_less(records):
            self._records = sorted((header, name, size, crc) for name, header, size, crc in records
                                   if size and 0 <= header < tail)
        self._starts = [r[0] for r in self._records]
        self._claimed: set[int] = set()  # indices of records taken (checked or being checked)
        self.active = bool(self._records)
        if self.active:
            self._mark(tail, self.size - tail)

    def landed(self, start: int, n: int) -> None:
        if not self.active or n <= 0:
            return
        with self._lock:
            self._mark(start, n)
            # the records a piece can complete: the one it starts in, and those starting inside it
            lo = max(bisect.bisect_right(self._starts, start) - 1, 0)
            hi = bisect.bisect_left(self._starts, start + n)
            ready = [w for w in (self._whole(i) for i in range(lo, hi) if i not in self._claimed) if w is not None]
            self._claimed.update(i for i, _ in ready)
        for i, data in ready:
            self._check(i, data)

    def _mark(self, start: int, n: int) -> None:
        """The pages wholly inside ``[start, start + n)`` have landed (the file's last page ends where it does)."""
        first = -(-start // _PAGE)
        last = len(self._pages) if start + n >= self.size else (start + n) // _PAGE
        if last > first:
            self._pages[first:last] = b"\x01" * (last - first)

    def _has(self, start: int, end: int) -> bool:
        """Whether every page of ``[start, end)`` has landed (called under the lock)."""
        return self._pages.find(0, start // _PAGE, -(-end // _PAGE)) == -1

    def _whole(self, i: int) -> tuple[int, int] | None:
        """``(i, data offset)`` if record ``i``'s local header and data have landed, else None."""
        header, _, size, _ = self._records[i]
        if header + _LOCAL_HEADER > self.size or not self._has(header, header + _LOCAL_HEADER):
            return None
        try:  # zipdir's own parse of a local header, over the bytes that have landed
            data = data_offset(_Tail(self.view, header), header)
        except IntegrityError:
            return None  # not a local header: the parse of the whole file says so, naming the record
        if data + size > self.size or not self._has(header, data + size):
            return None
        return i, data

    def _check(self, i: int, data: int) -> None:
        _, name, size, want = self._records[i]
        got = crc32(self.view[data:data + size])
        if got != want:
            raise mismatch(self.path, name, got, want, self.advice)
        with self._lock:
            self.done.add((data, size, want))
