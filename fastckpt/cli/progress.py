"""Progress in bytes for the commands that read or write whole checkpoints (``verify``, ``export``, ``import``).

A count of checkpoints would sit at 0/1 for the minutes one large checkpoint takes: the bytes read and
written are counted instead, through ``CountingStorage`` (a wrapper of any ``Storage``: every
``read_into`` and write is counted; ``read_bytes`` reads a step at a time so that a large file moves
the count too) and ``counting_file`` (a file object for ``torch.load``).

Shown on stderr when it is a terminal, or with ``--progress`` (then also into a log); never otherwise:
output piped or captured stays exactly the command's own. On a terminal the line is redrawn with a
carriage return alone, never an ANSI escape; elsewhere a line is written at each tenth of the total.
The wrappers are installed only while progress is shown, so that an unobserved run keeps the storage's
fast paths (``LocalStorage``'s mapped reads).
"""
from __future__ import annotations

import io
import sys
import threading
import time
from typing import Any, Callable, Sequence, TextIO

from .text import clean, human_size

__all__ = ["ByteProgress", "CountingStorage", "counting_file", "wanted"]

_READ_STEP = 8 << 20  # ``read_bytes`` through ``CountingStorage``: bytes per ``read_into``, one count each


def wanted(flag: bool | None, stream: TextIO | None = None) -> bool:
    """Whether to show progress: ``--progress`` (True), ``--no-progress`` (False), else whether ``stream``
    (stderr) is a terminal."""
    if flag is not None:
        return flag
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class ByteProgress:
    """``what: 12.0 MB / 40.0 MB (30%)`` on ``stream``; ``add(n)`` from any thread."""

    def __init__(self, what: str, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.what, self.total, self.enabled = clean(what), max(int(total), 0), enabled
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._tty = wanted(None, self._stream)
        self._shown = -1  # the last percent (terminal) or tenth (log) written
        self._width = 0
        self._lock = threading.Lock()
        self._started = time.monotonic()

    def add(self, n: int) -> None:
        if not self.enabled or n <= 0:
            return
        with self._lock:
            self.done += n
            # Re-reads (a meta file read twice) may pass the total: the line never says more than 100%.
            shown = min(self.done, self.total) if self.total else self.done
            pct = 100 * shown // self.total if self.total else 0
            mark = pct if self._tty else pct // 10
            if mark == self._shown:
                return
            self._shown = mark
            self._write(f"{self.what}: {human_size(shown)} / {human_size(self.total)} ({pct}%)")

    def close(self) -> None:
        """End the line (terminal) or write the last one (log), with the rate."""
        if not self.enabled:
            return
        with self._lock:
            seconds = max(time.monotonic() - self._started, 1e-6)
            done = min(self.done, self.total) if self.total else self.done  # re-reads are not the checkpoint's
            self._write(f"{self.what}: {human_size(done)} in {seconds:.1f} s ({human_size(done / seconds)}/s)")
            if self._tty:
                self._stream.write("\n")
            self._stream.flush()
            self.enabled = False

    def _write(self, line: str) -> None:
        if self._tty:  # redraw in place: a carriage return, the line, blanks over a longer previous one
            self._stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self._stream.write(line + "\n")
        self._stream.flush()

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CountingStorage:
    """A ``Storage`` that tells ``count(n)`` of each ``n`` bytes read or written through it."""

    # Readers map a LocalStorage shard instead of reading it when ``map_file`` exists: bytes then arrive by page
    # faults nobody counts. Hidden here, every byte goes through ``read_into``.
    map_file = None

    def __init__(self, inner: Any, count: Callable[[int], None]) -> None:
        self.inner = inner
        self.url = inner.url
        self._count = count

    def __getattr__(self, name: str) -> Any:  # listdir, size, exists, delete...: as the wrapped storage does
        return getattr(self.inner, name)

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.inner.read_into(path, offset, out)
        self._count(out.nbytes)

    def read_bytes(self, path: str) -> bytes:
        size = self.inner.size(path)
        if size <= _READ_STEP:
            data = self.inner.read_bytes(path)
            self._count(len(data))
            return data
        out = bytearray(size)
        view = memoryview(out)
        for at in range(0, size, _READ_STEP):
            self.read_into(path, at, view[at: at + _READ_STEP])
        return bytes(out)

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        self.inner.write_file(path, parts)
        self._count(sum(memoryview(p).nbytes for p in parts))

    def write_file_atomic(self, path: str, parts: Sequence[memoryview]) -> None:
        self.inner.write_file_atomic(path, parts)
        self._count(sum(memoryview(p).nbytes for p in parts))

    def write_atomic(self, path: str, data: bytes) -> None:
        self.inner.write_atomic(path, data)
        self._count(len(data))


class _CountingFile(io.RawIOBase):
    """A seekable read-only file over a local path that counts the bytes read (``torch.load`` reads through it)."""

    def __init__(self, path: str, count: Callable[[int], None]) -> None:
        self._f = open(path, "rb", buffering=0)
        self._count = count

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        self._count(n or 0)
        return n or 0

    def close(self) -> None:
        self._f.close()
        super().close()


def counting_file(path: str, count: Callable[[int], None]) -> io.BufferedReader:
    """``open(path, "rb")`` whose reads tell ``count(n)``."""
    return io.BufferedReader(_CountingFile(path, count), 1 << 20)
