"""A cold torch file's records checked while it is read (fastckpt.read.zipcheck, issue 27): every record once, the
same error for a damaged one, and nothing weaker than the check after the read for a file the tail cannot vouch for."""
from __future__ import annotations

import logging
import mmap
import os
import random
from pathlib import Path

import pytest
import torch

from fastckpt import IntegrityError
from fastckpt.format.torchfile import record_spans
from fastckpt.read import readers, strategy, torchzip, zipcheck
from fastckpt.read.pagecache import resident_fraction
from fastckpt.read.torchzip import load_torch_file
from tests.helpers import assert_bit_equal, drop_page_cache


@pytest.fixture(autouse=True)
def _small_pieces(monkeypatch):
    monkeypatch.setattr(readers, "LOCAL_PIECE_BYTES", 256 << 10)  # many pieces: records complete out of order
    monkeypatch.setattr(readers, "SEQUENTIAL_PIECE_BYTES", 384 << 10)
    strategy.forget()
    yield
    strategy.forget()


def _state(n: int = 12) -> dict:
    g = torch.Generator().manual_seed(7)
    state = {f"w{i}": torch.randn((1 << 18) + 13 * i, generator=g) for i in range(n)}  # ~1 MiB each, unaligned ends
    state.update(b=torch.randn(33, 7, generator=g).to(torch.bfloat16), step=3, names=["a", "b"])
    return state


def _saved(tmp_path: Path, state: dict | None = None) -> tuple[Path, dict]:
    state = _state() if state is None else state
    path = tmp_path / "model.ckpt"
    torch.save(state, path)
    drop_page_cache(path)
    if resident_fraction(str(path), path.stat().st_size) > 0.1:
        pytest.skip(f"{tmp_path} keeps its pages cached after POSIX_FADV_DONTNEED (tmpfs?): no cold reads here")
    return path, state


class _Spy:
    def __init__(self, monkeypatch) -> None:
        self.checks: list[zipcheck.EarlyCheck] = []
        self.after: list[set] = []  # the records check_records was left with, per call
        spy = self

        class Early(zipcheck.EarlyCheck):
            def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
                super().__init__(*a, **kw)
                spy.checks.append(self)

        real = torchzip.check_records

        def check(path, view, spans, workers, **kw):  # type: ignore[no-untyped-def]
            done = kw.get("done", ())
            spy.after.append({(s[1], s[2], s[3]) for s in spans if (s[1], s[2], s[3]) not in done})
            return real(path, view, spans, workers, **kw)

        monkeypatch.setattr(torchzip, "EarlyCheck", Early)
        monkeypatch.setattr(torchzip, "check_records", check)


@pytest.mark.parametrize("how", ["sequential", "parallel", "direct"])
def test_every_record_before_the_tail_is_checked_while_the_file_is_read(tmp_path, monkeypatch, how) -> None:
    path, state = _saved(tmp_path)
    spy = _Spy(monkeypatch)
    got = load_torch_file(str(path), workers=3, strategy=how)
    assert_bit_equal(torch.load(path, weights_only=True), got)
    (early,) = spy.checks
    tail = (path.stat().st_size - zipcheck.TAIL) // 4096 * 4096
    spans = record_spans(str(path))
    before = {(o, n, c) for name, o, n, c in spans if n and o < tail}
    assert early.active and len(before) >= 12 and before <= early.done  # every tensor record, while reading
    assert spy.after == [{(o, n, c) for _, o, n, c in spans} - early.done]  # the rest: only the tail's records


def test_a_probe_s_regions_count_as_landed(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(strategy, "PROBE_BYTES", 512 << 10)
    monkeypatch.setattr(strategy, "_PROBE_BELOW", 1)
    path, _ = _saved(tmp_path)
    spy = _Spy(monkeypatch)
    probed: list[tuple] = []
    real = strategy.measure_read
    monkeypatch.setattr(strategy, "measure_read", lambda *a: (probed.append(a[2:4]), real(*a))[1])
    got = load_torch_file(str(path))
    assert len(probed) == 6  # the probe ran, into the load's buffer
    assert_bit_equal(torch.load(path, weights_only=True), got)
    (early,) = spy.checks
    tail = (path.stat().st_size - zipcheck.TAIL) // 4096 * 4096
    assert {(o, n, c) for _, o, n, c in record_spans(str(path)) if n and o < tail} <= early.done


def test_a_damaged_record_fails_the_read_with_the_same_error(tmp_path, monkeypatch) -> None:
    path, _ = _saved(tmp_path)
    tensors = sorted((s for s in record_spans(str(path)) if s[2] > 1 << 19), key=lambda s: s[1])
    name, offset, size, crc = tensors[3]  # a tensor's record, well before the tail
    with open(path, "r+b") as f:
        f.seek(offset + size // 2)
        b = f.read(1)
        f.seek(offset + size // 2)
        f.write(bytes([b[0] ^ 0x10]))
    drop_page_cache(path)
    spy = _Spy(monkeypatch)
    with pytest.raises(IntegrityError, match=rf"{path}: record '{name}' has CRC-32 .* its zip entry says {crc:08x}; "
                                             r"the checkpoint is damaged: resume from an earlier one"):
        load_torch_file(str(path), workers=2)
    assert spy.after == []  # raised by the read itself, before the check that follows it
    assert load_torch_file(str(path), verify=False)["step"] == 3


def test_a_directory_beyond_the_tail_leaves_every_record_to_the_check_after(tmp_path, monkeypatch) -> None:
    """Thousands of records: their directory is longer than TAIL (here made small), so nothing is checked early,
    and everything still is, after the read."""
    monkeypatch.setattr(zipcheck, "TAIL", 256 << 10)
    monkeypatch.setattr(torchzip, "TAIL", 256 << 10)
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(5_000)}  # ~0.4 MiB of directory
    state["big"] = torch.randn(1 << 20)
    path, _ = _saved(tmp_path, state)
    spy = _Spy(monkeypatch)
    assert_bit_equal(state, load_torch_file(str(path)))
    (early,) = spy.checks
    assert not early.active and early.done == set()
    assert spy.after == [{(o, n, c) for _, o, n, c in record_spans(str(path))}]


def test_a_file_without_crc32s_is_loaded_with_the_warning_cold_too(tmp_path, monkeypatch, caplog) -> None:
    torch.serialization.set_crc32_options(False)
    try:
        path, state = _saved(tmp_path)
    finally:
        torch.serialization.set_crc32_options(True)
    spy = _Spy(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        assert_bit_equal(state, load_torch_file(str(path)))
    assert not spy.checks[0].active  # no CRC-32 to hold the bytes to: a zero would read as a mismatch
    assert "written with torch's crc32 option off" in caplog.text


def test_a_local_header_that_is_not_one_is_refused_as_before(tmp_path) -> None:
    """The directory points a record at bytes that are no local header: the early check skips it, and the parse of
    the whole file refuses the file, naming it (as a cached load does)."""
    path, _ = _saved(tmp_path)
    offset = sorted(record_spans(str(path)), key=lambda s: s[1])[2][1]
    with open(path, "r+b") as f:  # the local header of a tensor record, 30 + name + extra bytes before its data
        data = f.read()
        at = data.rfind(b"PK\x03\x04", 0, offset)
        f.seek(at)
        f.write(b"XX\x03\x04")
    drop_page_cache(path)
    with pytest.raises(IntegrityError, match=rf"{path}: no zip local header at offset {at}"):
        load_torch_file(str(path))


def test_pieces_landing_in_any_order_check_each_record_exactly_once(tmp_path, monkeypatch) -> None:
    path, _ = _saved(tmp_path)
    raw = path.read_bytes()
    size = len(raw)
    mm = mmap.mmap(-1, size)
    view = memoryview(mm)
    tail = (size - zipcheck.TAIL) // 4096 * 4096
    view[tail:] = raw[tail:]
    checked: list[int] = []
    real = zipcheck.EarlyCheck._check
    monkeypatch.setattr(zipcheck.EarlyCheck, "_check", lambda self, i, data: (checked.append(i), real(self, i, data)))
    early = zipcheck.EarlyCheck(str(path), view, tail, "advice")
    assert early.active
    pieces = [(at, min(40960, tail - at)) for at in range(0, tail, 40960)]
    random.Random(5).shuffle(pieces)
    for k, (at, n) in enumerate(pieces):
        view[at:at + n] = raw[at:at + n]
        early.landed(at, n)
        early.landed(at, n)  # a piece reported twice checks nothing twice
    assert sorted(checked) == sorted(set(checked))
    assert early.done == {(o, n, c) for _, o, n, c in record_spans(str(path)) if n and o < tail}
    view.release()
    mm.close()
    assert os.path.getsize(path) == size


@pytest.mark.parametrize("field", ["size", "header"])
def test_a_directory_entry_pointing_past_the_file_is_refused_cold_as_cached(tmp_path, field) -> None:
    """A crafted central directory: a record's size, or its local header offset, points past the end of the file.
    The early check leaves such a record alone (nothing outside the file is read) and the load is refused, naming
    the file, as a cached load refuses it."""
    import struct

    from fastckpt.format.zipdir import _Mapped, central_entries

    path, _ = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    name, header, pos = max(central_entries(_Mapped(memoryview(bytes(data)), len(data))),
                            key=lambda e: next(s[2] for s in record_spans(str(path)) if s[0] == e[0]))
    if field == "size":  # compressed and uncompressed size alike: still a "stored" record
        data[pos + 20:pos + 28] = struct.pack("<II", len(data), len(data))
    else:
        data[pos + 42:pos + 46] = struct.pack("<I", len(data) - 10)
    path.write_bytes(bytes(data))
    errors = []
    for cold in (True, False):
        if cold:
            drop_page_cache(path)
        else:
            path.read_bytes()  # cached: the mapped path
        with pytest.raises(IntegrityError) as ei:
            load_torch_file(str(path))
        assert str(path) in str(ei.value)
        errors.append(str(ei.value))
    assert errors[0] == errors[1]  # the same refusal either way
