"""fastckpt.format.checksum: the two checksums every file's integrity rests on, against their standard values."""
from __future__ import annotations

import importlib
import os
import random
import sys
import zlib

import pytest

import fastckpt.format.checksum as checksum
from fastckpt.format.checksum import combine, crc32, crc32c

CHECK = b"123456789"  # the check input of the CRC catalogue


def test_crc32c_and_crc32_give_the_catalogue_check_values() -> None:
    assert crc32c(CHECK) == 0xE3069283  # CRC-32C (Castagnoli)
    assert crc32(CHECK) == 0xCBF43926  # CRC-32 (ISO-HDLC): what zip's records and torch's files carry


@pytest.mark.parametrize("fn", [crc32c, crc32])
def test_each_continues_from_a_value_like_one_pass(fn) -> None:
    data = os.urandom(1 << 16)
    rng = random.Random(7)
    for _ in range(20):
        cut = rng.randrange(len(data) + 1)
        assert fn(data[cut:], fn(data[:cut])) == fn(data)
    assert fn(memoryview(data)[5:900]) == fn(data[5:900])  # a memoryview slice reads the same bytes


def test_crc32_is_unsigned_and_equals_zlib() -> None:
    for n in (0, 1, 7, 4096, 1 << 20):
        data = os.urandom(n)
        assert crc32(data) == zlib.crc32(data) & 0xFFFFFFFF
        assert 0 <= crc32(data) <= 0xFFFFFFFF


def test_combine_gives_the_checksum_of_the_concatenation() -> None:
    rng = random.Random(3)
    for _ in range(30):
        a, b = os.urandom(rng.randrange(0, 5000)), os.urandom(rng.randrange(0, 5000))
        assert combine(crc32c(a), crc32c(b), len(b)) == crc32c(a + b)


def test_crc32_without_zlib_ng_falls_back_to_zlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """zlib-ng is a declared dependency, but a missing one must cost speed only, never a wrong checksum."""
    monkeypatch.setitem(sys.modules, "zlib_ng", None)  # ``import zlib_ng...`` now raises ImportError
    monkeypatch.setitem(sys.modules, "zlib_ng.zlib_ng", None)
    try:
        plain = importlib.reload(checksum)
        assert plain._zip_crc32 is zlib.crc32
        data = os.urandom(100_000)
        assert plain.crc32(data) == crc32(data)
        assert plain.crc32(CHECK) == 0xCBF43926
    finally:
        monkeypatch.undo()
        importlib.reload(checksum)
    assert checksum._zip_crc32 is not zlib.crc32  # zlib-ng again, for the tests that follow


def _combine_bitwise(crc_a: int, crc_b: int, len_b: int) -> int:
    """The reference: zlib's crc32_combine, each zero-byte operator applied column by column (the former code)."""
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = checksum._gf2_times(checksum._ZERO_OPS[k], crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b


def test_combine_by_tables_equals_the_bitwise_operators_for_any_length() -> None:
    """combine applies each operator by byte tables (a writer combines hundreds of CRCs a shard); its values are
    the bitwise operators' for every CRC and length, lengths up to 2**64 - 1 included."""
    rng = random.Random(11)
    cases = [(rng.getrandbits(32), rng.getrandbits(32), rng.getrandbits(rng.randrange(1, 65))) for _ in range(5000)]
    cases += [(0xFFFFFFFF, 0, (1 << 64) - 1), (0, 0xFFFFFFFF, 1), (0x80000000, 1, 1 << 40), (5, 7, 0)]
    for a, b, n in cases:
        assert combine(a, b, n) == _combine_bitwise(a, b, n), (a, b, n)


def test_combine_chains_tensor_crcs_into_the_file_crc() -> None:
    """As a writer does: the CRCs of a header and of each tensor, combined, give the file's CRC; combining the
    tensors' first and the header's last gives the same."""
    rng = random.Random(5)
    header = os.urandom(4096)
    parts = [os.urandom(n) for n in (0, 1, 511, 4096, 65537, 3 * 4096 + 17)] + [os.urandom(rng.randrange(1, 9000))
                                                                                 for _ in range(20)]
    chained = crc32c(header)
    data = 0
    for p in parts:
        chained = combine(chained, crc32c(p), len(p))
        data = combine(data, crc32c(p), len(p))
    whole = header + b"".join(parts)
    assert chained == crc32c(whole) == combine(crc32c(header), data, len(whole) - len(header))
