"""Accelerate's fast load is never more lenient than stock, says exactly what it verified, and checks what it loads,
not bystanders (issue 22, items 7 and 10)."""

from __future__ import annotations

import json
import logging
import struct
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import fastckpt_accelerate
from accelerate_testing import (Setup, assert_same, make_accelerator,
                                closing, fresh_accelerate)  # noqa: F401 (the last two are fixtures)
from fastckpt.errors import IntegrityError
from fastckpt.format.checksum import crc32c
from fastckpt.format.torchfile import record_spans

pytestmark = pytest.mark.timeout(120)
RESTORED = ("model", "optimizer", "scheduler", "counter", "torch_rng", "numpy_rng", "python_rng", "step")


def _restored(snapshot: dict) -> dict:
    return {k: v for k, v in snapshot.items() if k in RESTORED}


def _folder(tmp_path: Path, closing: list, stock: bool) -> tuple[Setup, str, dict]:
    """A folder of Setup's state after 2 steps (stock: Accelerate's own writer, no manifest), that state, and the
    setup one step on, fastckpt enabled."""
    acc = make_accelerator(tmp_path, automatic=False)
    setup = Setup(acc)
    if not stock:
        closing.append(fastckpt_accelerate.enable(acc))
    for _ in range(2):
        setup.step()
    expected = setup.snapshot()
    if stock:
        folder = str(tmp_path / "stock")
        type(acc).save_state(acc, folder)
        closing.append(fastckpt_accelerate.enable(acc))
    else:
        folder = acc.save_state(str(tmp_path / "checkpoint_2"))
        closing[-1].wait()
    setup.step()
    return setup, folder, expected


def _zip(entries: list[tuple[str, bytes]]) -> bytes:
    """A stored zip of ``entries`` with right CRC-32s (as torch.save's, but unaligned: torch's reader takes it)."""
    out, central = bytearray(), bytearray()
    for name, data in entries:
        raw, crc, at = name.encode(), zlib.crc32(data), len(out)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, 0, 0, 0, crc, len(data), len(data), len(raw), 0)
        out += raw + data
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, 0, 0, 0, crc, len(data), len(data),
                               len(raw), 0, 0, 0, 0, 0, at) + raw
    cd = len(out)
    return bytes(out + central + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(entries), len(entries),
                                             len(central), cd, 0))


def _relist(folder: str, name: str, drop: bool = False) -> None:
    """Rewrite the manifest's record of ``name`` to the file as it is now (or drop it), as a planter would."""
    path = Path(folder, "manifest.json")
    doc = json.loads(path.read_text())
    if drop:
        del doc["files"][name]
    else:
        data = Path(folder, name).read_bytes()
        doc["files"][name].update(size=len(data), crc32c=crc32c(data))
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("stock", [True, False], ids=["stock-folder", "native-folder"])
def test_optimizer_bin_whose_pickle_oversizes_a_storage_is_refused_as_stock_refuses_it(tmp_path, closing, stock):
    setup, folder, _ = _folder(tmp_path, closing, stock)
    file = Path(folder, "optimizer.bin")
    state = torch.load(file, weights_only=True)
    grown = {**state, "state": {k: dict(v) for k, v in state["state"].items()}}
    first = grown["state"][0]
    first["exp_avg"] = torch.cat([first["exp_avg"].flatten(), torch.zeros(2)])  # 8 more bytes than its record
    torch.save(grown, tmp_path / "grown.bin")
    with zipfile.ZipFile(file) as original, zipfile.ZipFile(tmp_path / "grown.bin") as other:
        pkl = other.read(next(n for n in other.namelist() if n.endswith("/data.pkl")))
        entries = [(i.filename, pkl if i.filename.endswith("/data.pkl") else original.read(i))
                   for i in original.infolist()]
    file.write_bytes(_zip(entries))  # every CRC right: only the size the pickle asks for is wrong
    if not stock:
        _relist(folder, "optimizer.bin")  # the manifest agrees: the check against it passes
    with pytest.raises(RuntimeError, match="record size .* does not match"):
        torch.load(file, weights_only=True)  # what stock Accelerate's load does with it
    before = setup.snapshot()
    with pytest.raises(IntegrityError, match=r"optimizer\.bin: record 'data/\d+' holds \d+ bytes but the pickle "
                                             r"asks for \d+ \(record size does not match"):
        setup.accelerator.load_state(folder)
    assert_same(before["optimizer"], setup.snapshot()["optimizer"])  # not loaded, shifted or otherwise


def test_an_optimizer_bin_the_manifest_does_not_list_is_reported_exactly(tmp_path, closing, caplog):
    setup, folder, expected = _folder(tmp_path, closing, stock=False)
    _relist(folder, "optimizer.bin", drop=True)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        setup.accelerator.load_state(folder)
    assert_same(_restored(expected), _restored(setup.snapshot()))
    stats = closing[-1].last_load_stats
    assert stats.files["optimizer.bin"] == "read" and stats.checked["optimizer.bin"] == "zip"
    assert stats.verified is False  # was True: "every byte read was checked against the manifest"
    assert all(how == "manifest" for name, how in stats.checked.items() if name != "optimizer.bin"), stats.checked
    assert "optimizer.bin: not listed in the manifest" in caplog.text
    # its own zip CRC-32s are still checked: a flipped byte is refused, naming it
    file = Path(folder, "optimizer.bin")
    name, offset, size, _ = max(record_spans(str(file)), key=lambda s: s[2])
    sound = file.read_bytes()
    data = bytearray(sound)
    data[offset + size // 2] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=rf"optimizer\.bin: record '{name}' has CRC-32"):
        setup.accelerator.load_state(folder)
    # a load leaving the reads to stock cannot vouch for the unlisted file either
    file.write_bytes(sound)
    setup.accelerator.load_state(folder, load_kwargs={"mmap": True})
    stats = closing[-1].last_load_stats
    assert stats.verified is False and "optimizer.bin not in the manifest" in stats.fallbacks["*"]


def test_a_listed_folder_still_reports_verified(tmp_path, closing):
    setup, folder, expected = _folder(tmp_path, closing, stock=False)
    setup.accelerator.load_state(folder)
    stats = closing[-1].last_load_stats
    assert stats.verified is True and set(stats.checked.values()) == {"manifest"}
    assert set(stats.checked) == set(stats.files)
    assert_same(_restored(expected), _restored(setup.snapshot()))


def test_damaged_bystanders_in_a_stock_folder_do_not_block_its_load(tmp_path, closing):
    setup, folder, expected = _folder(tmp_path, closing, stock=True)
    damaged = bytearray(Path(folder, "optimizer.bin").read_bytes())
    _, offset, size, _ = max(record_spans(str(Path(folder, "optimizer.bin"))), key=lambda s: s[2])
    damaged[offset + size // 2] ^= 0x01  # a zip whose biggest record fails its CRC-32
    for bystander in ("notes.zip", "optimizer_old.bin", "random_states_1.pkl"):  # the last: another process's
        Path(folder, bystander).write_bytes(bytes(damaged))
    setup.accelerator.load_state(folder)  # stock Accelerate loads this folder: so does fastckpt
    assert_same(_restored(expected), _restored(setup.snapshot()))
    stats = closing[-1].last_load_stats
    assert not {"notes.zip", "optimizer_old.bin", "random_states_1.pkl"} & (set(stats.files) | set(stats.checked))
    assert stats.checked["optimizer.bin"] == "zip" and stats.checked["model.safetensors"] == "none"
    assert stats.verified is False
    # what is loaded is still checked: the same damage in the optimizer.bin it loads is refused, naming it
    Path(folder, "optimizer.bin").write_bytes(bytes(damaged))
    with pytest.raises(IntegrityError, match=r"optimizer\.bin.*CRC-32"):
        setup.accelerator.load_state(folder)
