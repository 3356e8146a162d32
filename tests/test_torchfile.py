"""torch's own file format as a layout: fixed bytes from ``torch.save`` + storage ranges filled by the engine."""
from __future__ import annotations

import io
import zipfile
from types import SimpleNamespace

import pytest
import torch

from fastckpt.format.torchfile import TorchFileFormat, plan_torch_file, storage_bytes, verify_torch_file


def _state() -> dict:
    base = torch.randn(64, 33)
    return {
        "state_dict": {"w": base, "view": base[3:7, 1:5], "bf16": torch.randn(5, 7).to(torch.bfloat16),
                       "i64": torch.arange(11), "bool": torch.tensor([True, False, True]),
                       "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(8, 8)}},
                              "param_groups": [{"lr": 1e-3, "params": [0]}]}],
        "epoch": 2, "global_step": 17, "hyper_parameters": {"name": "tiny", "dims": [1, 2, 3]},
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 3}}}},
    }


def _materialize(layout) -> bytearray:
    """What the engine does: each record's CRC-32 as the I/O workers compute it, then the committer's parts
    (fixed bytes with the CRCs filled in, around each storage's bytes)."""
    fmt = TorchFileFormat(layout, "unused")
    data = memoryview(b"".join(storage_bytes(r.storage).numpy().tobytes() for r in layout.records))
    entries, views, offset = [], {}, 0
    for i, r in enumerate(layout.records):
        entries.append(SimpleNamespace(index=i, offset=offset, nbytes=r.nbytes))
        views[i] = data[offset:offset + r.nbytes]
        offset += r.nbytes
    return bytearray(b"".join(fmt.parts(views, fmt.checksum(data, entries))))


def _assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b.view(torch.uint8) if b.dtype == torch.bool else b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_layout_is_torch_save_byte_for_byte_but_the_crcs(tmp_path) -> None:
    state = _state()
    layout = plan_torch_file(state)
    image = _materialize(layout)
    reference = io.BytesIO()
    torch.save(state, reference)
    ref = reference.getvalue()
    assert len(image) == len(ref)
    # torch.save's own CRCs equal the ones the engine computed, so the files match except the serialization id
    with zipfile.ZipFile(io.BytesIO(bytes(image))) as ours, zipfile.ZipFile(io.BytesIO(ref)) as theirs:
        assert [i.filename for i in ours.infolist()] == [i.filename for i in theirs.infolist()]
        for a, b in zip(ours.infolist(), theirs.infolist()):
            if "data/" in a.filename and not a.filename.endswith("serialization_id"):
                assert (a.header_offset, a.CRC, a.file_size) == (b.header_offset, b.CRC, b.file_size), a.filename


def test_written_file_loads_with_weights_only_and_passes_zip_checks(tmp_path) -> None:
    state = _state()
    layout = plan_torch_file(state)
    path = tmp_path / "epoch=0-step=17.ckpt"
    path.write_bytes(_materialize(layout))
    loaded = torch.load(path, weights_only=True)
    _assert_same(state, loaded)
    # the view still shares its base's storage after loading, as torch.save preserves it
    assert loaded["state_dict"]["view"].untyped_storage().data_ptr() == loaded["state_dict"]["w"].untyped_storage().data_ptr()
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every record's CRC-32 is right
    assert verify_torch_file(str(path)) == []


def test_a_shared_storage_is_one_record() -> None:
    base = torch.arange(100, dtype=torch.float32)
    layout = plan_torch_file({"a": base, "b": base[10:20], "c": base.view(10, 10)})
    assert len(layout.records) == 1 and layout.records[0].nbytes == 400


def test_records_are_aligned_and_do_not_overlap_the_fixed_bytes() -> None:
    layout = plan_torch_file(_state())
    taken = sorted([(off, off + len(d)) for off, d in layout.segments] +
                   [(r.offset, r.offset + r.nbytes) for r in layout.records if r.nbytes])
    for (a0, a1), (b0, b1) in zip(taken, taken[1:]):
        assert a1 <= b0
    assert all(r.offset % 64 == 0 for r in layout.records if r.nbytes)
    assert taken[-1][1] == layout.size


def test_verify_names_a_flipped_byte_and_a_truncated_file(tmp_path) -> None:
    layout = plan_torch_file(_state())
    image = _materialize(layout)
    victim = max(layout.records, key=lambda r: r.nbytes)
    image[victim.offset + 5] ^= 0x40
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(image)
    problems = verify_torch_file(str(bad))
    assert len(problems) == 1 and f"data/{victim.key}" in problems[0] and "bad.ckpt" in problems[0]
    short = tmp_path / "short.ckpt"
    short.write_bytes(image[: len(image) // 2])
    assert verify_torch_file(str(short)) and "short.ckpt" in verify_torch_file(str(short))[0]
    foreign = tmp_path / "foreign.ckpt"
    foreign.write_bytes(b"{\"not\": \"a zip\"}")
    assert "foreign.ckpt" in verify_torch_file(str(foreign))[0]


def test_record_checksums_match_zlib() -> None:
    import zlib

    layout = plan_torch_file({"x": torch.randn(1000)})
    image = _materialize(layout)
    rec = layout.records[0]
    crc = TorchFileFormat(layout, "unused").checksum(memoryview(image), [SimpleNamespace(index=0, offset=rec.offset,
                                                                                         nbytes=rec.nbytes)])
    assert crc == {0: zlib.crc32(bytes(image[rec.offset:rec.offset + rec.nbytes]))}


def test_planning_moves_no_tensor_bytes() -> None:
    big = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB: the skeleton stays a few KB
    layout = plan_torch_file({"big": big})
    assert layout.size > 64 << 20
    assert sum(len(d) for _, d in layout.segments) < 8192


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.complex64])
def test_dtypes_round_trip(tmp_path, dtype) -> None:
    src = torch.randn(6, 5).to(dtype) if dtype != torch.int8 else torch.randint(-100, 100, (6, 5), dtype=dtype)
    layout = plan_torch_file({"t": src})
    path = tmp_path / "t.pt"
    path.write_bytes(_materialize(layout))
    got = torch.load(path, weights_only=True)["t"]
    assert got.dtype == dtype and torch.equal(got.view(torch.uint8), src.view(torch.uint8))
