"""The parallel torch-zip reader (issue 13): torch.load's result, verified records, storages over the read buffer."""
from __future__ import annotations

import os
import zlib

import pytest
import torch

from fastckpt import IntegrityError
from fastckpt.read.pagecache import resident_fraction
from fastckpt.read.readers import PIECE_BYTES
from fastckpt.format.torchfile import record_spans
from fastckpt.read.torchzip import load_torch_file
from tests.helpers import assert_bit_equal, drop_page_cache


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(PIECE_BYTES // 4 + 17, generator=g)  # a record of two pieces
    return {"w": w, "view": w[10:20], "bf16": torch.randn(33, 7, generator=g).to(torch.bfloat16),
            "i": torch.arange(5), "mask": torch.tensor([True, False]), "epoch": 3, "names": ["a", "b"],
            "nested": {"c": torch.randn(3, dtype=torch.complex64, generator=g)}}


def _drop(path) -> None:
    """Evict ``path`` from the page cache: the next load reads it cold (O_DIRECT), as after a reboot."""
    drop_page_cache(path)
    if resident_fraction(str(path), os.path.getsize(path)) > 0.1:
        pytest.skip(f"{path} stays cached after POSIX_FADV_DONTNEED (tmpfs?): no cold reads here")


@pytest.mark.parametrize("cold", [False, True], ids=["cached-map", "cold-read"])
def test_loads_what_torch_load_loads_bit_for_bit(tmp_path, cold) -> None:
    state = _state()
    path = tmp_path / "x.ckpt"
    torch.save(state, path)
    if cold:
        _drop(path)
    got = load_torch_file(str(path), workers=4, strategy="direct" if cold else "auto")
    if cold:
        assert resident_fraction(str(path), os.path.getsize(path)) < 0.5  # O_DIRECT: read around the page cache
    assert got["w"].untyped_storage().nbytes() > 0
    assert_bit_equal(torch.load(path, weights_only=True), got)
    assert got["view"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()  # views stay views
    got["w"][0] = 1.0  # writable, like torch.load's result


@pytest.mark.parametrize("cold", [False, True], ids=["cached-map", "cold-read"])
def test_a_corrupt_record_is_named(tmp_path, cold) -> None:
    path = tmp_path / "x.ckpt"
    torch.save(_state(), path)
    name, offset, size, crc = max(record_spans(str(path)), key=lambda s: s[2])  # the big record
    with open(path, "r+b") as f:
        f.seek(offset + size - 5)
        b = f.read(1)
        f.seek(offset + size - 5)
        f.write(bytes([b[0] ^ 1]))
    if cold:
        _drop(path)
    with pytest.raises(IntegrityError, match=rf"record '{name}' has CRC-32 .* its zip entry says {crc:08x}") as ei:
        load_torch_file(str(path))
    assert str(path) in str(ei.value)
    assert load_torch_file(str(path), verify=False)["epoch"] == 3  # verify=False loads it anyway


def test_refuses_what_weights_only_refuses(tmp_path) -> None:
    path = tmp_path / "x.ckpt"
    torch.save({"f": zlib.compressobj}, path)  # a function: not a weights-only object
    with pytest.raises(Exception, match="weights_only|Unsupported"):
        load_torch_file(str(path))
