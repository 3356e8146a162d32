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
from fastckpt.storage.protocol import open_storage
from helpers import WrappedStorage


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


def test_without_o_tmpfile_the_named_temporary_gets_the_record_before_its_rename(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    import fastckpt.storage.local as local

    monkeypatch.setattr(local, "_UNNAMED_OK", False)  # a file system without O_TMPFILE: a named temporary file
    named: list[Any] = []
    real = os.setxattr
    monkeypatch.setattr(os, "setxattr", lambda t, *a, **k: (named.append((t, (tmp_path / "b.ckpt").exists())),
                                                            real(t, *a, **k)))
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save_file({"w": torch.ones(8)}, "b.ckpt", step=2).wait()
    assert named == [(named[0][0], False)] and isinstance(named[0][0], int)  # its descriptor, before the rename
    assert json.loads(os.getxattr(tmp_path / "b.ckpt", HEALTH_ATTR))["step"] == 2
    assert os.listdir(tmp_path) == ["b.ckpt"]


class OwnWrite(WrappedStorage):
    """Writes single files itself (never through LocalStorage.write_file_atomic), as a user's wrapper may."""

    def write_file_atomic(self, path: str, parts: Any) -> None:
        with open(path, "wb") as f:
            for part in parts:
                f.write(part)


def test_a_wrapper_that_writes_files_itself_gets_the_record_right_after(tmp_path: Path) -> None:
    storage = OwnWrite(open_storage(str(tmp_path)))
    with Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=storage) as ckpt:
        ckpt.save_file({"w": torch.full((4,), float("nan"))}, "c.ckpt", step=3).wait()
    record = json.loads(os.getxattr(tmp_path / "c.ckpt", HEALTH_ATTR))
    assert record["step"] == 3 and record["health"]["healthy"] is False and record["health"]["nan"] == 4
    assert os.listdir(tmp_path) == ["c.ckpt"]


def test_removing_a_local_file_never_deletes_a_user_file_named_like_a_sidecar(tmp_path) -> None:
    # Local records are extended attributes: a file with the sidecar's name beside a local .ckpt is the user's.
    from fastckpt import CheckpointConfig, Checkpointer
    from fastckpt.format.health import sidecar_path

    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save_file({"w": torch.ones(4)}, "a.ckpt").wait(timeout=60)
        users = tmp_path / ".a.ckpt.fastckpt-health.json"
        assert sidecar_path(str(tmp_path / "a.ckpt")) == str(users)
        users.write_text("the user's own notes")
        ckpt.remove_file("a.ckpt").result(timeout=60)
    assert not (tmp_path / "a.ckpt").exists()
    assert users.read_text() == "the user's own notes"
