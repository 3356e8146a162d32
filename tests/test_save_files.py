"""``Checkpointer.save_files``: a framework's folder (safetensors + torch files) as one save, manifest last."""
from __future__ import annotations

import errno
import os
from typing import Sequence

import pytest
import torch
from safetensors.torch import load_file

from fastckpt import CheckpointConfig, Checkpointer, StorageError
from fastckpt.format.bundle import PENDING, SAFETENSORS, TORCH
from fastckpt.errors import StateMismatchError
from fastckpt.read.loader import load_checkpoint
from fastckpt.storage.local import LocalStorage
from fastckpt.read.verify import verify_checkpoint
from tests.helpers import WrappedStorage


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    return model, opt


def _files(model, opt) -> dict:
    return {"model.safetensors": (SAFETENSORS, model.state_dict()), "optimizer.bin": (TORCH, opt.state_dict()),
            "rng.pkl": (TORCH, {"step": 3, "torch": torch.get_rng_state()})}


class FailSecondFile(WrappedStorage):
    """A full disk on the second framework file: it is torn, never renamed into place."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.files = 0
        self.armed = False

    def write_file_atomic(self, path: str, parts: Sequence[memoryview]) -> None:
        self.files += 1
        if self.armed and self.files == 2:
            raise StorageError(f"writing {path} failed: {os.strerror(errno.ENOSPC)} (injected)")
        self.inner.write_file_atomic(path, parts)


def test_each_file_is_in_its_own_format_and_the_manifest_lists_them(tmp_path):
    model, opt = _state()
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        info = ckpt.save_files(_files(model, opt), "ckpt_3", step=3, user={"who": "test"}).wait()
        folder = str(tmp_path / "ckpt_3")
        assert sorted(os.listdir(folder)) == ["manifest.json", "model.safetensors", "optimizer.bin", "rng.pkl"]
        assert [i.name for i in ckpt.list()] == ["ckpt_3"] and info.step == 3
    weights = load_file(os.path.join(folder, "model.safetensors"))  # the safetensors library reads it
    assert set(weights) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert weights[key].dtype == torch.bfloat16 and torch.equal(weights[key], value)
    saved_opt = torch.load(os.path.join(folder, "optimizer.bin"), weights_only=True)
    for p, state in opt.state_dict()["state"].items():
        assert torch.equal(saved_opt["state"][p]["exp_avg"], state["exp_avg"])
    manifest, problems = verify_checkpoint(LocalStorage(folder), folder)
    assert problems == [] and manifest["layout"] == "files" and manifest["user"] == {"who": "test"}
    with pytest.raises(StateMismatchError, match="framework's own files"):
        load_checkpoint(folder)


def test_a_failed_file_leaves_no_manifest_and_the_previous_folder_intact(tmp_path):
    model, opt = _state()
    storage = FailSecondFile(LocalStorage(str(tmp_path), direct_io="off"))
    with Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=storage) as ckpt:
        ckpt.save_files(_files(model, opt), "good").wait()  # files 1..3, no failure
        storage.files, storage.armed = 0, True
        with pytest.raises(StorageError, match="injected"):
            ckpt.save_files(_files(model, opt), "bad").wait()
        assert [i.name for i in ckpt.list()] == ["good"]
    bad = tmp_path / "bad"
    assert not (bad / "manifest.json").exists() and (bad / PENDING).exists()
    assert not (bad / "optimizer.bin").exists()  # the failed file never appeared under its name
    assert verify_checkpoint(LocalStorage(str(tmp_path / "good")), str(tmp_path / "good"))[1] == []


def test_shared_tensors_and_non_tensors_are_refused_as_safetensors_refuses_them(tmp_path):
    w = torch.zeros(4, 4)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        with pytest.raises(StateMismatchError, match="share memory"):
            ckpt.save_files({"m.safetensors": (SAFETENSORS, {"a": w, "b": w[1]})}, "x")
        with pytest.raises(StateMismatchError, match="tensors only"):
            ckpt.save_files({"m.safetensors": (SAFETENSORS, {"a": 1})}, "y")
