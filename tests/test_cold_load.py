"""Cold and warm local loads (issue 13): cold shards read with O_DIRECT into fresh buffers, cached ones mapped."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, IntegrityError, StorageError
from fastckpt.read import readers
from fastckpt.format.checksum import crc32c
from fastckpt.read.pagecache import resident_fraction
from fastckpt.read.readers import LOCAL_PIECE_BYTES, Range, read_ranges
from fastckpt.storage.local import LocalStorage, aligned_buffer
from tests.helpers import assert_bit_equal, drop_page_cache


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(LOCAL_PIECE_BYTES // 4 * 2 + 1234, generator=g),  # three pieces, the last short
            "bf16": torch.randn(300, 77, generator=g).to(torch.bfloat16),
            "ids": torch.randint(0, 1 << 40, (999,), generator=g),
            "rng": torch.get_rng_state(), "step": 11}


def _shards(folder: str) -> list[Path]:
    return sorted(Path(folder).glob("shard-*.safetensors"))


def _warm(path: Path) -> None:
    path.read_bytes()


def _cold_capable(path: Path) -> None:
    drop_page_cache(path)
    if resident_fraction(str(path), path.stat().st_size) > 0.1:
        pytest.skip(f"{path.parent} keeps its pages cached after POSIX_FADV_DONTNEED (tmpfs?): no cold reads here")


@pytest.fixture
def saved(tmp_path):
    state = _state()
    ckpt = Checkpointer(CheckpointConfig(root=str(tmp_path / "root"), persist={"chunk_bytes": 1 << 20}))
    ckpt.save(state, step=1).wait()
    yield ckpt, state, ckpt.list()[-1].path
    ckpt.close()


def test_resident_fraction_follows_the_page_cache(saved) -> None:
    _, _, folder = saved
    shard = _shards(folder)[0]
    _cold_capable(shard)
    assert resident_fraction(str(shard), shard.stat().st_size) == 0.0
    _warm(shard)
    assert resident_fraction(str(shard), shard.stat().st_size) == 1.0


def test_cold_shards_are_read_with_o_direct_and_cached_ones_are_mapped(saved, monkeypatch) -> None:
    """``read.strategy: direct`` (``auto`` reads buffered unless the probe finds O_DIRECT faster)."""
    first, state, folder = saved
    ckpt = Checkpointer(CheckpointConfig(root=first.config.root, read={"strategy": "direct"}))
    shards = _shards(folder)
    assert len(shards) >= 2
    for s in shards:
        _cold_capable(s)
    opened: list[tuple[str, int]] = []
    real_open = os.open

    def spy(path, flags, *a):  # type: ignore[no-untyped-def]
        opened.append((str(path), flags))
        return real_open(path, flags, *a)

    monkeypatch.setattr(readers.os, "open", spy)
    assert_bit_equal(state, ckpt.load(step=1))
    assert ckpt.last_load_stats is not None and ckpt.last_load_stats.method == "read"
    direct = {p for p, flags in opened if flags & os.O_DIRECT}
    assert {str(s) for s in shards} <= direct  # every cold shard went through O_DIRECT
    for s in shards:
        assert resident_fraction(str(s), s.stat().st_size) < 0.5  # and did not fill the page cache

    for s in shards:
        _warm(s)
    opened.clear()
    assert_bit_equal(state, ckpt.load(step=1))
    assert ckpt.last_load_stats.method == "map" and not any(flags & os.O_DIRECT for _, flags in opened)

    drop_page_cache(shards[0])  # one cold, the others cached
    assert_bit_equal(state, ckpt.load(step=1))
    assert ckpt.last_load_stats.method == "map+read"
    ckpt.close()


def test_tensors_of_a_cold_load_are_fresh_memory_not_the_file(saved) -> None:
    ckpt, state, folder = saved
    for s in _shards(folder):
        _cold_capable(s)
    before = [s.read_bytes() for s in _shards(folder)]
    for s in _shards(folder):
        drop_page_cache(s)
    got = ckpt.load(step=1)
    got["big"].add_(1.0)  # training writes the loaded tensors in place
    assert [s.read_bytes() for s in _shards(folder)] == before
    assert_bit_equal(state, ckpt.load(step=1))


def test_a_forked_child_writing_a_cold_loads_tensors_leaves_the_parents_alone(saved) -> None:
    """The fresh buffers are private memory, as torch's own tensors are: a forked DataLoader worker that writes a
    loaded tensor writes its own copy (shared anonymous memory would carry the write into the trainer)."""
    ckpt, state, folder = saved
    for s in _shards(folder):
        _cold_capable(s)
        drop_page_cache(s)
    got = ckpt.load(step=1)
    pid = os.fork()
    if pid == 0:  # the child: write (small slices: no OpenMP region after a fork), leave without any cleanup
        got["big"][:1000].fill_(42.0)
        got["ids"][:10].zero_()
        os._exit(0 if float(got["big"][999]) == 42.0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert_bit_equal(state, got)


@pytest.mark.parametrize("cached", [False, True], ids=["cold-read", "cached-map"])
def test_a_flipped_byte_names_the_file_and_tensor(saved, cached) -> None:
    ckpt, _, folder = saved
    big = next(e for e in ckpt.reader(1).entries if e.key == "big")
    shard = Path(folder) / big.file
    at = big.offset + big.nbytes - 1000  # in the last, short piece of "big"
    with open(shard, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    if cached:
        _warm(shard)
    else:
        _cold_capable(shard)
    with pytest.raises(IntegrityError, match=r"checksum mismatch in tensor 'big'") as ei:
        ckpt.load(step=1)
    assert str(shard) in str(ei.value)


def test_a_filesystem_refusing_o_direct_is_read_buffered(tmp_path) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm (tmpfs) on this machine")
    data = os.urandom(3 * LOCAL_PIECE_BYTES + 777)
    path = Path("/dev/shm") / f"fastckpt-test-{os.getpid()}-{tmp_path.name}.bin"
    path.write_bytes(data)
    try:
        keep, view = aligned_buffer(len(data))
        r = Range(str(path), 0, view, crc32c(data), direct=True)
        assert read_ranges(LocalStorage(str(path.parent)), [r], 2) == len(data)
        assert bytes(view) == data
        bad = Range(str(path), 0, aligned_buffer(len(data))[1], crc32c(data) ^ 1, direct=True,
                    culprit=lambda v: " in tensor 'x'")
        with pytest.raises(IntegrityError, match=r"fastckpt-test.*checksum mismatch in tensor 'x'"):
            read_ranges(LocalStorage(str(path.parent)), [bad], 2)
        del view, keep
    finally:
        path.unlink()


def test_a_load_onto_a_device_maps_even_cold_shards(saved) -> None:
    ckpt, state, folder = saved
    for s in _shards(folder):
        _cold_capable(s)
    got = ckpt.load(step=1, map_location="meta")  # copied onto a device: the host buffers are transient
    assert ckpt.last_load_stats.method == "map"
    assert got["big"].device.type == "meta" and got["big"].shape == state["big"].shape
    for s in _shards(folder):
        drop_page_cache(s)
    assert_bit_equal(state, ckpt.load(step=1, map_location="cpu"))  # CPU tensors: private memory, read
    assert ckpt.last_load_stats.method == "read"


@pytest.mark.parametrize("step", [2 << 20, (3 << 20) + 1, 1 << 30])
@pytest.mark.parametrize("how", ["parallel", "sequential"])
def test_buffered_reads_checksummed_in_steps_verify_every_byte(tmp_path, monkeypatch, step, how) -> None:
    """A buffered piece is read and CRC'd in LOCAL_CRC_STEP steps (``sequential``: whole, CRC'd by the checker
    thread): every step's bytes count (a step size that cuts pieces unevenly, or exceeds them), and a flip in any
    step of any piece fails the range, naming the file."""
    monkeypatch.setattr(readers, "LOCAL_CRC_STEP", step)
    data = bytearray(os.urandom(3 * LOCAL_PIECE_BYTES + 777))
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    out = bytearray(len(data))
    r = Range(str(path), 0, memoryview(out), crc32c(bytes(data)))
    assert read_ranges(LocalStorage(str(tmp_path)), [r], 2, strategy=how) == len(data)
    assert out == data
    for at in (5, LOCAL_PIECE_BYTES + (2 << 20) + 9, len(data) - 1):  # first step, a later step, the tail
        bad = bytearray(data)
        bad[at] ^= 0x10
        path.write_bytes(bad)
        r = Range(str(path), 0, memoryview(bytearray(len(data))), crc32c(bytes(data)), what=" in tensor 'w'")
        with pytest.raises(IntegrityError, match=r"shard\.bin: checksum mismatch in tensor 'w'"):
            read_ranges(LocalStorage(str(tmp_path)), [r], 2, strategy=how)


def _files(tmp_path: Path, sizes: list[int]) -> list[tuple[Path, bytes]]:
    out = []
    for k, n in enumerate(sizes):
        data = os.urandom(n)
        (tmp_path / f"f{k}.bin").write_bytes(data)
        out.append((tmp_path / f"f{k}.bin", data))
    return out


def _tensor_ranges(files: list[tuple[Path, bytes]], size: int) -> list[Range]:
    """Each file cut into ``size`` ranges (tensors), listed out of order, each verified."""
    ranges = [Range(str(p), at, memoryview(bytearray(len(data[at:at + size]))), crc32c(data[at:at + size]),
                    what=f" in tensor {p.name}@{at}") for p, data in files for at in range(0, len(data), size)]
    return ranges[::-1]


def _checkers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "fastckpt-read-check"]


def test_sequential_reads_on_one_thread_in_file_order_and_checksums_behind_it(tmp_path, monkeypatch) -> None:
    """``sequential``: one thread issues every read, in file order, one pread per piece; the CRC32C of each piece is
    taken by the checker thread, which is gone when the read returns."""
    monkeypatch.setattr(readers, "SEQUENTIAL_PIECE_BYTES", 1 << 20)
    files = _files(tmp_path, [(5 << 20) + 99, (3 << 20) + 7])
    reads: list[tuple[str, int, int, int]] = []
    crcs: list[str] = []
    real_pread, real_crc = readers.pread_all, readers.crc32c

    def pread(fd, out, offset):  # type: ignore[no-untyped-def]
        reads.append((threading.current_thread().name, os.fstat(fd).st_size, offset, len(out)))
        real_pread(fd, out, offset)

    def crc(data, value=0):  # type: ignore[no-untyped-def]
        crcs.append(threading.current_thread().name)
        return real_crc(data, value)

    monkeypatch.setattr(readers, "pread_all", pread)
    monkeypatch.setattr(readers, "crc32c", crc)
    ranges = _tensor_ranges(files, (1 << 20) + (1 << 19))  # pieces of 1 MiB and 0.5 MiB: ranges split unevenly
    assert read_ranges(LocalStorage(str(tmp_path)), ranges, 8, strategy="sequential") == sum(len(d) for _, d in files)
    for r in ranges:
        assert bytes(r.out) == dict((str(p), d) for p, d in files)[r.path][r.offset: r.offset + len(r.out)]
    assert {name for name, *_ in reads} == {threading.current_thread().name}
    sizes = [size for _, size, _, _ in reads]
    assert sizes == [len(files[0][1])] * sizes.count(len(files[0][1])) + [len(files[1][1])] * sizes.count(
        len(files[1][1]))  # one file after the other, in path order
    for size in {s for _, s, _, _ in reads}:
        offsets = [at for _, s, at, _ in reads if s == size]
        assert offsets == sorted(offsets) and len(offsets) == len(set(offsets))  # in order, each byte once
    assert max(n for *_, n in reads) == 1 << 20 and len(crcs) == len(reads)  # one pread and one CRC a piece
    assert set(crcs) == {"fastckpt-read-check"} and _checkers() == []


@pytest.mark.parametrize("fault", ["corrupt", "truncated", "on_done"])
def test_a_sequential_failure_stops_both_threads_and_is_raised_once(tmp_path, monkeypatch, fault) -> None:
    """A checksum mismatch (found by the checker), a file that ends early (found by the reader) or a failing
    ``on_done`` (run by the checker): the one error reaches the caller, naming the file, and no thread is left."""
    monkeypatch.setattr(readers, "SEQUENTIAL_PIECE_BYTES", 256 << 10)
    files = _files(tmp_path, [4 << 20])
    path, data = files[0]
    ranges = _tensor_ranges(files, 256 << 10)
    done: list[Range] = []

    def on_done(r: Range) -> None:
        done.append(r)
        if fault == "on_done" and len(done) == 3:
            raise RuntimeError("the copy of the third tensor failed")

    if fault == "corrupt":
        bad = bytearray(data)
        bad[(1 << 20) + 5] ^= 1
        path.write_bytes(bad)
        expected: tuple[type, str] = (IntegrityError, rf"f0\.bin: checksum mismatch in tensor f0\.bin@{1 << 20}")
    elif fault == "truncated":
        path.write_bytes(data[: 3 << 20])
        expected = (StorageError, r"reading '.*f0\.bin' failed: file ended after")
    else:
        expected = (RuntimeError, "the copy of the third tensor failed")
    with pytest.raises(expected[0], match=expected[1]):
        read_ranges(LocalStorage(str(tmp_path)), ranges, 2, on_done=on_done, strategy="sequential")
    assert _checkers() == []
    if fault == "on_done":
        assert len(done) == 3  # nothing ran after the failure
