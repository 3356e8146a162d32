"""A local torch file's health record is an extended attribute set on the unnamed file before it takes its name
(fastckpt/storage/xattr.py): no reader ever sees the file without its record, and nothing else appears beside it."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.format.health import HEALTH_ATTR


def test_the_record_is_set_on_the_descriptor_before_the_file_is_named(tmp_path: Path, monkeypatch) -> None:
    real = os.setxattr
    seen: list[tuple[Any, bool]] = []

    def spy(target: Any, name: str, value: bytes, *args: Any, **kwargs: Any) -> None:
        seen.append((target, (tmp_path / "a.ckpt").exists()))
        real(target, name, value, *args, **kwargs)

    monkeypatch.setattr(os, "setxattr", spy)
    state = {"w": torch.randn(64, 3), "step": 5}
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save_file(state, "a.ckpt", step=5).wait()
        ckpt.save_file({"w": state["w"] * 2}, "a.ckpt", step=6).wait()  # replacing: the new file's own record
    assert len(seen) == 2 and all(isinstance(t, int) for t, _ in seen)  # a descriptor: fsetxattr(2)
    assert seen[0][1] is False  # not yet named when its record was set
    record = json.loads(os.getxattr(tmp_path / "a.ckpt", HEALTH_ATTR))
    assert record["step"] == 6 and record["health"]["healthy"] is True
    assert torch.equal(torch.load(tmp_path / "a.ckpt", weights_only=True)["w"], state["w"] * 2)
    assert os.listdir(tmp_path) == ["a.ckpt"]
