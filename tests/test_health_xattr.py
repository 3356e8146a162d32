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


def _same_size_nan_file(path: Path, like: dict[str, Any]) -> None:
    """A stock torch file (``torch.save``) of ``like``'s structure, every float a NaN: what a user copies over a
    checkpoint by mistake. Saved through a buffer, so its zip records are named like fastckpt's (``archive/``)."""
    import io

    buf = io.BytesIO()
    torch.save({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in like.items()}, buf)
    path.write_bytes(buf.getvalue())


def test_a_file_copied_over_a_checkpoint_does_not_inherit_its_health_record(tmp_path: Path, capsys) -> None:
    import subprocess

    from fastckpt.cli import main
    from fastckpt.format.health import file_health
    from fastckpt_lightning import find_healthy_checkpoint

    folder = tmp_path / "ckpt"
    state = {"w": torch.randn(64, 3), "b": torch.randn(3)}
    with Checkpointer(CheckpointConfig(root=str(folder))) as ckpt:
        ckpt.save_file(state, "epoch=0-step=1.ckpt", step=1).wait()
        ckpt.save_file({k: v * 2 for k, v in state.items()}, "epoch=0-step=2.ckpt", step=2).wait()
    newest = folder / "epoch=0-step=2.ckpt"
    _same_size_nan_file(tmp_path / "nan.ckpt", state)
    assert (tmp_path / "nan.ckpt").stat().st_size == newest.stat().st_size  # the size cannot tell them apart
    subprocess.run(["cp", str(tmp_path / "nan.ckpt"), str(newest)], check=True)  # rewrites in place: same inode
    assert json.loads(os.getxattr(newest, HEALTH_ATTR))["health"]["healthy"] is True  # the stale record is there
    assert torch.load(newest, weights_only=True)["w"].isnan().all()
    assert file_health(open_storage(str(folder)), str(newest)) is None  # ...and not believed: other bytes
    assert find_healthy_checkpoint(str(folder)) == str(folder / "epoch=0-step=1.ckpt")
    assert main(["list", str(folder), "--json"]) == 0
    assert [r["health"] for r in json.loads(capsys.readouterr().out)] == ["ok", "-"]


def test_a_record_without_its_content_digest_is_not_believed(tmp_path: Path) -> None:
    # what fastckpt wrote before records were tied to the content: nothing proves it was measured on these bytes
    from fastckpt_lightning import find_healthy_checkpoint

    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save_file({"w": torch.ones(8)}, "a.ckpt", step=2).wait()
    assert find_healthy_checkpoint(str(tmp_path)) == str(tmp_path / "a.ckpt")
    record = json.loads(os.getxattr(tmp_path / "a.ckpt", HEALTH_ATTR))
    del record["zip"]
    os.setxattr(tmp_path / "a.ckpt", HEALTH_ATTR, json.dumps(record).encode())
    assert find_healthy_checkpoint(str(tmp_path)) is None


def test_an_object_uploaded_over_a_checkpoint_does_not_inherit_its_sidecar(tmp_path: Path) -> None:
    import uuid

    import fsspec

    from fastckpt_lightning import find_healthy_checkpoint

    root = f"memory://fastckpt-{uuid.uuid4().hex}"
    state = {"w": torch.randn(64, 3)}
    with Checkpointer(CheckpointConfig(root=root)) as ckpt:
        ckpt.save_file(state, "a.ckpt", step=1).wait()
        ckpt.save_file(state, "b.ckpt", step=2).wait()
    assert find_healthy_checkpoint(root) == f"{root}/b.ckpt"
    _same_size_nan_file(tmp_path / "nan.ckpt", state)
    with fsspec.open(f"{root}/b.ckpt", "rb") as f:
        assert len(f.read()) == (tmp_path / "nan.ckpt").stat().st_size
    with fsspec.open(f"{root}/b.ckpt", "wb") as f:  # an upload over the object; its sidecar stays
        f.write((tmp_path / "nan.ckpt").read_bytes())
    assert fsspec.filesystem("memory").exists(f"{root}/.b.ckpt.fastckpt-health.json")
    assert find_healthy_checkpoint(root) == f"{root}/a.ckpt"
