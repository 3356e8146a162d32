"""Several buffers read as one object: what a planned upload (``s3copy.py``) slices when a file is written as parts.

A shard is a header and the staged bytes, a torch file its fixed bytes around the staged records: joining them
into one buffer would copy the whole file. A slice that lies in one buffer is a view of it; one that spans buffers
is copied (at most one part, ``partplan.SEND_PART``, per part in flight).
"""
from __future__ import annotations

import bisect
from typing import Sequence

__all__ = ["Joined"]


class Joined:
    """``parts`` read as one byte string: ``len`` and contiguous slices (``[a:b]``, step 1) only."""

    def __init__(self, parts: Sequence[memoryview | bytes | bytearray]) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts if len(p)]
        self._starts: list[int] = []
        at = 0
        for p in self._parts:
            self._starts.append(at)
            at += len(p)
        self._size = at

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, s: slice) -> memoryview | bytes:
        if not isinstance(s, slice) or s.step not in (None, 1):
            raise TypeError("Joined supports contiguous slices only")
        a, b, _ = s.indices(self._size)
        if b <= a:
            return b""
        i = bisect.bisect_right(self._starts, a) - 1
        off = a - self._starts[i]
        if off + (b - a) <= len(self._parts[i]):  # within one buffer: a view, no copy
            return self._parts[i][off: off + b - a]
        out = bytearray()
        while len(out) < b - a:
            piece = self._parts[i][off: off + (b - a - len(out))]
            out += piece
            i, off = i + 1, 0
        return bytes(out)
