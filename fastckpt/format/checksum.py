"""CRC32C checksums with combination, so per-tensor checksums yield the file checksum.

Writers checksum each tensor's bytes once; the file's checksum (what the manifest
records, verifiable with any crc32c tool) is derived with ``combine`` instead of a
second pass over the data. On a mismatch the per-tensor values name the bad tensor.

``crc32`` is the other checksum: zip's CRC-32, which a torch file's records carry (written by
``format.torchfile``, checked by ``format.zipdir`` and the torch zip reader).
"""
from __future__ import annotations

import zlib

import crc32c as _crc32c

try:  # 5x the speed of the stdlib's crc32 here, and it releases the GIL on large buffers
    from zlib_ng.zlib_ng import crc32 as _zip_crc32
except ImportError:  # pragma: no cover - the dependency is declared; keep working without it
    _zip_crc32 = zlib.crc32

__all__ = ["crc32c", "combine", "crc32"]

_POLY = 0x82F63B78  # reflected Castagnoli polynomial


def crc32c(data: bytes | memoryview, value: int = 0) -> int:
    """CRC32C of ``data``, continuing from ``value``. Releases the GIL on large buffers."""
    return _crc32c.crc32c(data, value)


def crc32(data: bytes | memoryview, value: int = 0) -> int:
    """Zip's CRC-32 of ``data`` (unsigned), continuing from ``value``. Releases the GIL on large buffers."""
    return _zip_crc32(data, value) & 0xFFFFFFFF


def _gf2_times(mat: list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _zero_operators() -> list[list[int]]:
    # ops[k] appends 2**k zero *bytes* to a CRC; built once so combine() costs one
    # matrix-vector product per set bit of the length.
    one_bit = [_POLY] + [1 << n for n in range(31)]
    op = _gf2_square(_gf2_square(_gf2_square(one_bit)))  # 8 zero bits = 1 zero byte
    ops = []
    for _ in range(64):
        ops.append(op)
        op = _gf2_square(op)
    return ops


_ZERO_OPS = _zero_operators()


def _byte_tables(k: int) -> list[int]:
    """``_ZERO_OPS[k]`` as four 256-entry tables, one per byte of a CRC (its image is the XOR of theirs): built
    once per ``k`` used, so that applying the operator costs four look-ups, not up to 32 XORs in a Python loop."""
    table = _TABLES[k]
    if table is None:
        cols = _ZERO_OPS[k]
        table = [0] * 1024
        for byte in range(4):
            base = byte * 256
            for i in range(1, 256):
                low = i & -i  # each entry from a smaller one: one XOR with the column of its lowest bit
                table[base + i] = table[base + (i ^ low)] ^ cols[byte * 8 + low.bit_length() - 1]
        _TABLES[k] = table
    return table


_TABLES: list[list[int] | None] = [None] * len(_ZERO_OPS)


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A || B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's algorithm, each operator applied by
    table look-ups: a writer combines every tensor's CRC, hundreds a shard)."""
    k = 0
    while len_b:
        if len_b & 1:
            t = _TABLES[k] or _byte_tables(k)
            crc_a = (t[crc_a & 0xFF] ^ t[256 + (crc_a >> 8 & 0xFF)] ^ t[512 + (crc_a >> 16 & 0xFF)]
                     ^ t[768 + (crc_a >> 24)])
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b
