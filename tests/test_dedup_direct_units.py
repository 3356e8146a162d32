"""The pure parts of dedup for direct object-store roots: ``storage/joined.py`` (a file's parts sliced as one) and
the records sidecar of a torch file read as hostile input (``format/torchrecords.parse_records``)."""
from __future__ import annotations

import json
import os

import pytest

from fastckpt.errors import IntegrityError
from fastckpt.format.torchrecords import parse_records, records_path
from fastckpt.storage.joined import Joined

HEX = "0123456789abcdef" * 2


def test_joined_slices_equal_those_of_the_concatenation() -> None:
    parts = [os.urandom(n) for n in (4096, 0, 1, 7000, 3, 65536)]
    whole = b"".join(parts)
    j = Joined([memoryview(p) for p in parts])
    assert len(j) == len(whole)
    for a, b in [(0, 4096), (0, len(whole)), (4000, 4200), (4096, 4097), (4095, 11100), (11000, 11200),
                 (len(whole) - 5, len(whole)), (10, 10), (5000, 3)]:
        assert bytes(j[a:b]) == whole[a:b], (a, b)
    assert isinstance(j[10:20], memoryview)  # within one part: a view, no copy
    with pytest.raises(TypeError):
        j[0:10:2]


def _doc(**over) -> bytes:
    doc = {"format": "fastckpt-records", "size": 100, "crc32c": "AAAAAA==-2",
           "xxh3_128": [[0, 40, HEX], [40, 60, HEX]]}
    doc.update(over)
    return json.dumps(doc).encode()


def test_a_well_formed_records_sidecar_parses() -> None:
    size, tag, recs = parse_records(_doc(), "s")
    assert size == 100 and tag == "AAAAAA==-2" and [(r.offset, r.length) for r in recs] == [(0, 40), (40, 60)]


@pytest.mark.parametrize("data", [
    b"not json", b"[1, 2]", b'{"format": "fastckpt-health", "size": 1}', b"\xff\xfe",
    b"[" * 100_000,  # nested past the recursion limit
    _doc(size="100"), _doc(crc32c=None),
    _doc(xxh3_128=[[0, 40, HEX], [41, 59, HEX]]),  # a hole: does not tile the file
    _doc(xxh3_128=[[0, 40, HEX], [40, 70, HEX]]),  # leaves the file
    _doc(xxh3_128=[[0, 40, HEX], [40, 60, "XYZ" + HEX[3:]]]),  # not a hash
    _doc(xxh3_128=[[0, 100, HEX], [100, 0, HEX]]),  # an empty record
    _doc(xxh3_128="all"),
])
def test_a_hostile_records_sidecar_is_refused_by_name(data: bytes) -> None:
    with pytest.raises(IntegrityError, match="side.json"):
        parse_records(data, "side.json")


def test_the_records_sidecar_is_hidden_beside_its_file() -> None:
    assert records_path("s3://b/run/epoch=0-step=1.ckpt") == "s3://b/run/.epoch=0-step=1.ckpt.fastckpt-records"
    assert records_path("x.ckpt") == ".x.ckpt.fastckpt-records"
