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


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A || B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` (zlib's algorithm)."""
    k = 0
    while len_b:
        if len_b & 1:
            crc_a = _gf2_times(_ZERO_OPS[k], crc_a)
        len_b >>= 1
        k += 1
    return crc_a ^ crc_b
