"""Helpers shared by the tests/test_cli*.py files."""
from __future__ import annotations

import io
import struct
import zipfile


def flip_record_byte(data: bytes) -> bytes:
    """``data`` (a torch zip file) with one byte flipped inside its first non-empty tensor record.

    The record's bytes start after its *local* header, whose extra field (torch's alignment padding)
    differs from the central directory's: read its lengths there.
    """
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26: info.header_offset + 30])
    out = bytearray(data)
    out[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0x10
    return bytes(out)
