"""A big new file of unaligned parts (a Lightning ``.ckpt``, a stock Accelerate file) is written with O_DIRECT through a
bounce buffer (storage/directwrite.py): whole, exact, out of the page cache, and buffered where O_DIRECT is refused."""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
from pathlib import Path

import pytest

from fastckpt.errors import StorageError
from fastckpt.read.pagecache import resident_fraction
from fastckpt.storage import directwrite
from fastckpt.storage.local import LocalStorage


def _parts() -> tuple[list, bytes, list]:
    """Parts as a torch file has them: small gaps (bytes) around records of odd sizes at odd addresses (mmap slices
    past a page), ~41 MiB in all: two full bounce buffers and a partial, unaligned last block."""
    keep, parts = [], []
    for i, n in enumerate((100, (13 << 20) + 37, 64, (17 << 20) + 4095, 1, (11 << 20) + 123, 300)):
        if n < 4096:
            parts.append(memoryview(bytes([i + 1]) * n))
            continue
        m = mmap.mmap(-1, n + 64)
        keep.append(m)
        view = memoryview(m)[64:64 + n]
        view[:] = os.urandom(n)
        parts.append(view)
    return parts, b"".join(bytes(p) for p in parts), keep


class _Gate:
    """A CPU gate that counts its sections (engine/cpugate.py's role)."""

    def __init__(self) -> None:
        self.entered = 0

    @contextlib.contextmanager
    def __call__(self):
        self.entered += 1
        yield


def test_a_big_file_of_unaligned_parts_is_written_whole_and_out_of_the_page_cache(tmp_path) -> None:
    parts, whole, _keep = _parts()
    fast, slow = LocalStorage(str(tmp_path / "a")), LocalStorage(str(tmp_path / "b"), direct_io="off")
    gate = fast.cpu_section = _Gate()
    for storage in (fast, slow):
        path = Path(storage.url) / "x.ckpt"
        storage.write_file_atomic(str(path), parts)
        assert path.stat().st_size == len(whole) and path.read_bytes() == whole
    # read_bytes() above brought the pages in: write again, then look
    for storage in (fast, slow):
        os.remove(Path(storage.url) / "x.ckpt")
        storage.write_file_atomic(str(Path(storage.url) / "x.ckpt"), parts)
    assert resident_fraction(str(Path(fast.url) / "x.ckpt"), len(whole)) < 0.1  # O_DIRECT: nothing cached
    assert resident_fraction(str(Path(slow.url) / "x.ckpt"), len(whole)) > 0.9  # the buffered write's pages stay
    assert gate.entered >= len(parts)  # every copy into the bounce buffer passed the CPU gate


def test_a_small_file_stays_buffered(tmp_path, monkeypatch) -> None:
    def refuse(*args):
        raise AssertionError("a file under DIRECT_MIN went through the bounce buffer")

    monkeypatch.setattr(directwrite, "write_through_bounce", refuse)
    monkeypatch.setattr("fastckpt.storage.local.write_through_bounce", refuse)
    storage = LocalStorage(str(tmp_path))
    storage.write_file_atomic(str(tmp_path / "small.ckpt"), [memoryview(b"x" * (1 << 20))])
    assert (tmp_path / "small.ckpt").read_bytes() == b"x" * (1 << 20)


def test_a_filesystem_refusing_o_direct_at_open_gets_a_buffered_file() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    parts, whole, _keep = _parts()
    folder = Path(__import__("tempfile").mkdtemp(dir="/dev/shm"))
    try:
        storage = LocalStorage(str(folder))
        storage.write_file_atomic(str(folder / "x.ckpt"), parts)  # tmpfs: O_TMPFILE yes, O_DIRECT no
        assert (folder / "x.ckpt").read_bytes() == whole
    finally:
        __import__("shutil").rmtree(folder)


def test_o_direct_refused_at_write_time_is_written_buffered_and_remembered(tmp_path, monkeypatch) -> None:
    calls = []

    def refuse(fd, data, offset):
        calls.append(offset)
        raise OSError(errno.EINVAL, "Invalid argument")  # some FUSE mounts: accepted at open, refused at write

    monkeypatch.setattr(directwrite, "pwrite_all", refuse)
    parts, whole, _keep = _parts()
    storage = LocalStorage(str(tmp_path))
    storage.write_file_atomic(str(tmp_path / "x.ckpt"), parts)
    assert (tmp_path / "x.ckpt").read_bytes() == whole and calls == [0]
    storage.write_file_atomic(str(tmp_path / "y.ckpt"), parts)  # remembered: no second try
    assert calls == [0] and (tmp_path / "y.ckpt").read_bytes() == whole
    strict = LocalStorage(str(tmp_path), direct_io="on")
    with pytest.raises(StorageError, match="z.ckpt"):
        strict.write_file_atomic(str(tmp_path / "z.ckpt"), parts)
    assert not (tmp_path / "z.ckpt").exists()


def test_a_full_disk_mid_file_fails_naming_it_and_keeps_the_previous_file(tmp_path, monkeypatch) -> None:
    storage = LocalStorage(str(tmp_path))
    previous = b"the previous good checkpoint"
    (tmp_path / "x.ckpt").write_bytes(previous)
    real = directwrite.pwrite_all

    def fill(fd, data, offset):
        if offset:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    monkeypatch.setattr(directwrite, "pwrite_all", fill)
    parts, _, _keep = _parts()
    with pytest.raises(StorageError, match="x.ckpt") as info:
        storage.write_file_atomic(str(tmp_path / "x.ckpt"), parts)
    assert "No space left" in str(info.value)
    assert (tmp_path / "x.ckpt").read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.ckpt"]  # the unnamed file left nothing behind
