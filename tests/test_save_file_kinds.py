"""``save_file(kind="safetensors")`` and ``folder/name``, the bundle's external members, and a shared object's CRC32C
from its parts: the pieces Accelerate's shared S3 saves stand on (tests/test_accelerate_s3_shared.py runs them)."""
from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file as st_save_file

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.engine.sharedobject import whole_crc32c
from fastckpt.errors import ConfigError, FastCkptError, StorageError
from fastckpt.format.bundle import EXTERNAL, PENDING, TORCH
from fastckpt.format.checksum import crc32c


def _checkpointer(tmp_path) -> Checkpointer:
    return Checkpointer(CheckpointConfig(root=str(tmp_path / "root")))


def test_a_safetensors_file_is_safetensors_own_bytes_in_a_folder_of_the_root(tmp_path) -> None:
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 32), "b": torch.randn(32).to(torch.bfloat16), "n": torch.tensor(7)}
    ckpt = _checkpointer(tmp_path)
    try:
        ckpt.save_file(state, "checkpoint_0/model.safetensors", kind="safetensors").wait()
    finally:
        ckpt.close()
    st_save_file(state, str(tmp_path / "stock.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "root/checkpoint_0/model.safetensors").read_bytes() == (tmp_path / "stock.safetensors").read_bytes()


@pytest.mark.parametrize("name, kind", [("a/b/c.bin", "torch"), ("../x.bin", "torch"), ("x.bin", "zip")])
def test_a_deeper_or_escaping_name_and_an_unknown_kind_are_refused(tmp_path, name, kind) -> None:
    ckpt = _checkpointer(tmp_path)
    try:
        with pytest.raises(ConfigError, match="file name|kind"):
            ckpt.save_file({"t": torch.zeros(2)}, name, kind=kind)
    finally:
        ckpt.close()


def test_the_manifest_lists_an_external_file_as_its_save_reported_it(tmp_path) -> None:
    data = b"written by every rank" * 1000
    (tmp_path / "root/f").mkdir(parents=True)
    (tmp_path / "root/f/model.safetensors").write_bytes(data)
    ckpt = _checkpointer(tmp_path)
    try:
        files = {"model.safetensors": (EXTERNAL, lambda: (len(data), crc32c(data))),
                 "rng.pkl": (TORCH, {"step": 3})}
        ckpt.save_files(files, "f").wait()
    finally:
        ckpt.close()
    doc = json.loads((tmp_path / "root/f/manifest.json").read_bytes())
    assert doc["files"]["model.safetensors"] == {"size": len(data), "crc32c": crc32c(data)}
    assert list(doc["files"]) == ["model.safetensors", "rng.pkl"]


@pytest.mark.parametrize("outcome", ["failed", "no crc"])
def test_a_failed_external_file_commits_nothing(tmp_path, outcome) -> None:
    def wait() -> tuple[int, int | None]:
        if outcome == "failed":
            raise StorageError("rank 1 died mid-upload")
        return 10, None

    ckpt = _checkpointer(tmp_path)
    try:
        handle = ckpt.save_files({"optimizer.bin": (EXTERNAL, wait), "rng.pkl": (TORCH, {"step": 3})}, "f")
        with pytest.raises(FastCkptError, match="rank 1 died|CRC32C"):
            handle.wait()
    finally:
        ckpt.close()  # the failure was raised once, by wait()
    assert not (tmp_path / "root/f/manifest.json").exists()
    assert (tmp_path / "root/f" / PENDING).exists()  # visibly incomplete: no reader takes the folder


def test_an_objects_crc32c_is_combined_from_its_parts() -> None:
    rng = random.Random(0)
    bodies = [rng.randbytes(n) for n in (5 << 20, 1234, 5 << 20, 7)]
    done = [(i + 1, f"etag{i}", crc32c(b), len(b)) for i, b in enumerate(bodies)]
    rng.shuffle(done)  # the ranks' parts arrive in any order
    assert whole_crc32c(done) == crc32c(b"".join(bodies))
