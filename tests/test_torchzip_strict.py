"""The fast torch-zip readers are never more lenient than torch.load (issue 22, items 6, 7, 9): every record CRC-checked,
data.pkl included and matched case-insensitively as torch's reader matches names; every storage exactly its record;
zip64 edge cases and every other structural error an ``IntegrityError`` naming the file."""
from __future__ import annotations

import logging
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

from fastckpt import IntegrityError
from fastckpt.format.torchfile import record_spans, verify_torch_file
from fastckpt.read.torchzip import load_torch_file
from fastckpt_lightning.reader import read_checkpoint
from tests.helpers import assert_bit_equal, drop_page_cache

pytestmark = pytest.mark.timeout(60)
U32 = 0xFFFFFFFF


def _state() -> dict:
    return {"w": torch.arange(10, dtype=torch.float32), "lr": 0.12345, "global_step": 777,
            "b": torch.tensor([1, 2, 3], dtype=torch.int64)}


def _records(path: Path) -> list[tuple[str, bytes]]:
    """(name, bytes) of every entry of a torch file, in its order."""
    with zipfile.ZipFile(path) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _zip(entries: list[dict]) -> bytes:
    """A stored zip of ``entries`` (``name``, ``data``), each central entry's fields overridable: ``usize``,
    ``csize``, ``offset`` (the 32-bit values written), ``extra`` (its extra data), ``method``, ``crc``."""
    out, central = bytearray(), bytearray()
    for e in entries:
        name, data = e["name"].encode(), e["data"]
        crc = e.get("crc", zlib.crc32(data))
        at = len(out)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45, 0, 0, 0, 0, crc, len(data), len(data), len(name), 0)
        out += name + data
        extra = e.get("extra", b"")
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 45, 45, 0, e.get("method", 0), 0, 0, crc,
                               e.get("csize", len(data)), e.get("usize", len(data)), len(name), len(extra), 0, 0, 0,
                               0, e.get("offset", at))
        central += name + extra
    cd = len(out)
    out += central
    out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(central), cd, 0)
    return bytes(out)


def _rewrite(path: Path, out: Path, rename=lambda n: n, replace: dict | None = None) -> None:
    """``out``: the records of the torch file ``path`` in a zip of its own (CRCs right), names mapped by ``rename``,
    contents of the names in ``replace`` (by original name) replaced."""
    replace = replace or {}
    out.write_bytes(_zip([{"name": rename(n), "data": replace.get(n, d)} for n, d in _records(path)]))


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _span(path: Path, suffix: str) -> tuple[str, int, int, int]:
    return next(s for s in record_spans(str(path)) if s[0].lower().endswith(suffix))


def _refused(path: Path, match: str) -> None:
    """Every fast reader refuses ``path`` with an IntegrityError that names it."""
    with pytest.raises(IntegrityError, match=match) as ei:
        load_torch_file(str(path))
    assert str(path) in str(ei.value)
    with pytest.raises(IntegrityError, match=match) as ei:
        read_checkpoint(str(path))  # the Lightning plugin's fast path
    assert str(path) in str(ei.value)


# ---- item 6: every record, data.pkl included, matched case-insensitively ----------------------------------------


@pytest.mark.parametrize("cold", [False, True], ids=["cached-map", "cold-read"])
def test_a_flipped_bit_in_data_pkl_is_refused(tmp_path, cold) -> None:
    path = tmp_path / "x.ckpt"
    torch.save(_state(), path)
    name, offset, size, _ = _span(path, "data.pkl")
    pickled = path.read_bytes()[offset:offset + size]
    _flip(path, offset + pickled.index(struct.pack("<H", 777)))  # global_step's BININT2: 777 -> 776
    assert torch.load(path, weights_only=True)["global_step"] == 776  # stock resumes silently with the wrong value
    if cold:
        drop_page_cache(path)
    _refused(path, rf"record '{name}' has CRC-32")


def test_records_are_matched_case_insensitively_as_torch_matches_them(tmp_path) -> None:
    src = tmp_path / "src.ckpt"
    torch.save(_state(), src)
    path = tmp_path / "x.ckpt"
    _rewrite(src, path, rename=lambda n: n.replace("data.pkl", "DATA.PKL").replace("data/0", "DATA/0"))
    names = [n for n, _ in _records(path)]
    assert "src/DATA.PKL" in names and "src/DATA/0" in names
    assert_bit_equal(torch.load(path, weights_only=True), load_torch_file(str(path)))  # torch finds them: so do we
    for suffix in ("data.pkl", "data/0"):
        damaged = tmp_path / f"damaged-{suffix.replace('/', '-')}.ckpt"
        damaged.write_bytes(path.read_bytes())
        name, offset, size, _ = _span(damaged, suffix)
        record = damaged.read_bytes()[offset:offset + size]
        _flip(damaged, offset + (record.index(struct.pack("<H", 777)) if suffix == "data.pkl" else size - 1))
        torch.load(damaged, weights_only=True)  # stock reads the damaged record without a word
        _refused(damaged, rf"record '{name}' has CRC-32")


def test_two_records_equal_but_for_case_are_refused(tmp_path) -> None:
    src = tmp_path / "src.ckpt"
    torch.save(_state(), src)
    entries = [{"name": n, "data": d} for n, d in _records(src)]
    other = tmp_path / "other.ckpt"
    torch.save({"lr": 1e9, "global_step": 0}, other)
    entries.insert(1, {"name": "src/DATA.PKL", "data": dict(_records(other))["other/data.pkl"]})  # torch reads one or the other, by its search order
    path = tmp_path / "x.ckpt"
    path.write_bytes(_zip(entries))
    _refused(path, "differ only in case")


def test_a_record_whose_crc_reads_zero_is_checked_in_a_file_with_crcs(tmp_path) -> None:
    src = tmp_path / "src.ckpt"
    torch.save(_state(), src)
    entries = [{"name": n, "data": d} for n, d in _records(src)]
    pkl = next(e for e in entries if e["name"].endswith("data.pkl"))
    pkl["crc"] = 0  # the "crc32 option off" marker on one record only: damage does not get to opt out
    path = tmp_path / "x.ckpt"
    path.write_bytes(_zip(entries))
    _refused(path, r"record 'data.pkl' has CRC-32 .* says 00000000")


def test_a_file_written_without_crcs_loads_with_a_warning(tmp_path, caplog) -> None:
    path = tmp_path / "x.ckpt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(_state(), path)
    finally:
        torch.serialization.set_crc32_options(True)
    assert all(s[3] == 0 for s in record_spans(str(path)))
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        got = load_torch_file(str(path))
    assert_bit_equal(torch.load(path, weights_only=True), got)
    assert "crc32 option off" in caplog.text and str(path) in caplog.text


# ---- item 7: every storage is exactly its record --------------------------------------------------------------


@pytest.mark.parametrize("claimed", [12, 8], ids=["more", "fewer"])
def test_a_pickle_asking_for_another_size_than_its_record_is_refused(tmp_path, claimed) -> None:
    src, other = tmp_path / "src.ckpt", tmp_path / "other.ckpt"
    torch.save({"w": torch.arange(10, dtype=torch.float32), "after": torch.arange(4, dtype=torch.float32)}, src)
    # the same tree, but its first storage claims ``claimed`` elements: its data.pkl paired with src's records
    torch.save({"w": torch.arange(claimed, dtype=torch.float32), "after": torch.arange(4, dtype=torch.float32)}, other)
    pkl = dict(_records(other))["other/data.pkl"]
    path = tmp_path / "x.ckpt"
    _rewrite(src, path, replace={"src/data.pkl": pkl})
    with pytest.raises(RuntimeError, match="record size .* does not match"):
        torch.load(path, weights_only=True)  # stock refuses it
    _refused(path, r"record 'data/0' holds 40 bytes but the pickle asks for")


# ---- item 9: zip64 edge cases and every structural error name the file ------------------------------------------


def _torch_entries(tmp_path: Path) -> list[dict]:
    src = tmp_path / "src.ckpt"
    torch.save(_state(), src)
    return [{"name": n, "data": d} for n, d in _records(src)]


def _zip64(*values: int) -> bytes:
    return struct.pack(f"<HH{len(values)}Q", 0x0001, 8 * len(values), *values)


def test_a_zip64_size_in_the_extra_field_loads_as_torch_loads_it(tmp_path) -> None:
    entries = _torch_entries(tmp_path)
    e = next(e for e in entries if e["name"].endswith("data/0"))
    n = len(e["data"])
    at = _local_offset(_zip(entries), e["name"].encode())  # local headers come first: the central extras move none
    e.update(usize=U32, csize=U32, offset=U32, extra=_zip64(n, n, at))  # all three, in the spec's order
    path = tmp_path / "x.ckpt"
    path.write_bytes(_zip(entries))
    assert_bit_equal(torch.load(path, weights_only=True), load_torch_file(str(path)))
    assert verify_torch_file(str(path)) == []


def _local_offset(data: bytes, name: bytes) -> int:
    pos = 0
    while True:
        pos = data.index(b"PK\x03\x04", pos)
        n = struct.unpack("<H", data[pos + 26:pos + 28])[0]
        if data[pos + 30:pos + 30 + n] == name:
            return pos
        pos += 4


@pytest.mark.parametrize("case", ["one-value-for-two", "no-extra", "extra-runs-past", "csize-only-one-short"])
def test_malformed_zip64_extra_fields_are_integrity_errors_naming_the_file(tmp_path, case) -> None:
    entries = _torch_entries(tmp_path)
    e = next(e for e in entries if e["name"].endswith("data/0"))
    n = len(e["data"])
    if case == "one-value-for-two":  # size and offset overflow, one value: was a bare IndexError
        e.update(usize=U32, offset=U32, extra=_zip64(n))
    elif case == "no-extra":
        e.update(offset=U32)
    elif case == "extra-runs-past":
        e.update(usize=U32, extra=struct.pack("<HHQ", 0x0001, 16, n))
    else:  # the compressed size overflows: its value is the first one, and none is there
        e.update(csize=U32, extra=struct.pack("<HH", 0x0001, 0))
    path = tmp_path / "x.ckpt"
    path.write_bytes(_zip(entries))
    with pytest.raises(IntegrityError, match=r"'data/0'.*(zip64|extra)") as ei:
        record_spans(str(path))
    assert str(path) in str(ei.value)
    _refused(path, "zip64|extra")
    problems = verify_torch_file(str(path))
    assert problems and all(p.startswith(str(path)) for p in problems)


@pytest.mark.parametrize("case", ["no-end-record", "directory-past-end", "bad-local-header", "locator-past-end",
                                  "compressed"])
def test_structural_errors_name_the_file(tmp_path, case) -> None:
    entries = _torch_entries(tmp_path)
    if case == "compressed":
        entries[4]["method"] = 8
    data = bytearray(_zip(entries))
    eocd = len(data) - 22
    if case == "no-end-record":
        data = data[:-3]
    elif case == "directory-past-end":
        data[eocd + 16:eocd + 20] = struct.pack("<I", len(data) + 1000)
    elif case == "bad-local-header":  # a storage record's (the first 4 bytes still say "zip")
        at = _local_offset(bytes(data), entries[4]["name"].encode())
        data[at:at + 4] = b"PK\x00\x00"
    elif case == "locator-past-end":
        data[eocd + 16:eocd + 20] = struct.pack("<I", U32)  # "see the zip64 end record": the locator is garbage
    path = tmp_path / "x.ckpt"
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as ei:
        record_spans(str(path))
    assert str(path) in str(ei.value)
    _refused(path, ".")
