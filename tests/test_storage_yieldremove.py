"""Background removals yield to a walk of this process (issue 54, item 14): ``storage/yieldremove.py``.

A user's ``shutil.rmtree`` keeps every folder of its walk open from before it lists it until right before it removes
it. Retention's ``remove_folder`` removes nothing while the folder or one above it is open, so every name the walk
listed is still there when the walk unlinks it.
"""

from __future__ import annotations

import os
import threading

import pytest

import fastckpt.storage.yieldremove as yieldremove
from fastckpt.storage.yieldremove import remove_folder

pytestmark = pytest.mark.timeout(60)


def _tree(root) -> str:
    folder = root / "project" / "checkpoints" / "checkpoint_0"
    (folder / "sub").mkdir(parents=True)
    for name in ("manifest.json", "model.safetensors", "optimizer.bin", "sub/x.pkl"):
        (folder / name).write_bytes(b"x" * 4096)
    os.symlink("/etc/passwd", folder / "link")  # removed, never followed
    return str(folder)


def test_nothing_is_removed_while_a_folder_above_is_open(tmp_path):
    """A walk that never ends (a reader keeping the project open): after the patience nothing was removed, the
    manifest included; once it closes, the whole folder goes, the link's target untouched."""
    folder = _tree(tmp_path)
    fd = os.open(tmp_path / "project", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_folder(folder, first=["manifest.json"], patience_s=0.05) is False
    finally:
        os.close(fd)
    assert sorted(os.listdir(folder)) == ["link", "manifest.json", "model.safetensors", "optimizer.bin", "sub"]
    assert remove_folder(folder, first=["manifest.json"]) is True
    assert not os.path.lexists(folder) and os.path.exists("/etc/passwd")
    assert remove_folder(folder) is True  # already gone: nothing to do, no error


def test_a_walk_that_listed_the_folder_finds_every_name_it_listed(tmp_path, monkeypatch):
    """rmtree's steps by hand on the main thread while ``remove_folder`` runs on another: the walk opens the
    project, lists down to the checkpoint folder, waits until the remover has seen it and yielded, then unlinks and
    removes everything it listed: no ``FileNotFoundError``. The remover ends once the walk is done (True: gone)."""
    folder = _tree(tmp_path)
    yielded = threading.Event()
    real = yieldremove.remove_unwalked

    def watching(path, guards, *, folder=False):
        done = real(path, guards, folder=folder)
        if not done:
            yielded.set()
        return done

    monkeypatch.setattr(yieldremove, "remove_unwalked", watching)
    project = str(tmp_path / "project")
    top = os.open(project, os.O_RDONLY | os.O_DIRECTORY)
    result: list[bool] = []
    remover = threading.Thread(target=lambda: result.append(remove_folder(folder, ["manifest.json"], 30.0)),
                               name="test-remover")
    remover.start()
    assert yielded.wait(30)
    listed = sorted(os.listdir(folder))
    assert listed == ["link", "manifest.json", "model.safetensors", "optimizer.bin", "sub"]
    os.unlink(os.path.join(folder, "sub", "x.pkl"))  # FileNotFoundError here if the remover went ahead
    os.rmdir(os.path.join(folder, "sub"))
    for name in listed:
        if name != "sub":
            os.unlink(os.path.join(folder, name))
    os.rmdir(folder)
    os.rmdir(os.path.dirname(folder))
    os.close(top)
    os.rmdir(project)
    remover.join(30)
    assert result == [True]
