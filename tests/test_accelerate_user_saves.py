"""What a user's own code sees right after ``accelerator.save_state()`` (issue 23, items 2 and 14).

The contract (docs/accelerate.md, "When the files are there"): ``save_state()`` returns before the files are
written, and from that moment the folder shows ``.fastckpt-pending`` and no manifest, so a copy taken too early is
refused by every fastckpt reader (and lacks the files stock needs); ``wait_for_everyone()`` and ``end_training()``
return once every pending save has committed; a folder the user removes right after ``save_state()`` stays removed,
and the abandoned save says so once without failing the run.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading

import pytest

import fastckpt_accelerate
from accelerate_testing import (GatedStorage, Setup, assert_same, make_accelerator,
                                closing, fresh_accelerate)  # noqa: F401 (the last two are fixtures)
from fastckpt.errors import CheckpointNotFoundError, FolderRemovedError
from fastckpt.format.bundle import PENDING
from fastckpt.format.layout import MANIFEST

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def gated(closing):
    made: list[GatedStorage] = []

    def make(root) -> GatedStorage:
        made.append(GatedStorage(str(root)))
        return made[-1]

    yield make
    for storage in made:  # a failing test must not leave a writer waiting on a closed gate
        storage.gate.set()


class OneSaveAtATime(GatedStorage):
    """Closes its gate after each manifest: the next save's files (and a marker written by the background
    writer rather than inside save_state) wait until the test opens it again."""

    def write_atomic(self, path, data):
        if threading.current_thread() is not threading.main_thread() and not self.gate.wait(30):
            raise TimeoutError("test gate never opened")
        self._inner.write_atomic(path, data)

    def write_file_atomic(self, path, parts):
        super().write_file_atomic(path, parts)
        if os.path.basename(path) == MANIFEST:
            self.gate.clear()


def _enable(accelerator, closing, **kwargs):
    checkpointing = fastckpt_accelerate.enable(accelerator, **kwargs)
    closing.append(checkpointing)
    return checkpointing


def test_a_copy_taken_before_the_commit_is_marked_and_refused(tmp_path, closing, gated):
    acc = make_accelerator(tmp_path / "project")
    storage = gated(tmp_path / "project" / "checkpoints")
    _enable(acc, closing, storage=storage)
    setup = Setup(acc)
    setup.step()
    storage.gate.clear()  # the files cannot land yet: what a user's copytree sees right after save_state
    folder = acc.save_state()
    assert os.listdir(folder) == [PENDING]  # visibly incomplete the moment save_state returns
    copy = str(tmp_path / "uploaded")
    shutil.copytree(folder, copy)
    storage.gate.set()
    acc.wait_for_everyone()
    with pytest.raises(CheckpointNotFoundError, match="never committed"):
        acc.load_state(copy)
    stock = make_accelerator(tmp_path / "stock")  # stock Accelerate fails too: the model file is not there
    Setup(stock)
    with pytest.raises(FileNotFoundError):
        stock.load_state(copy)


def test_wait_for_everyone_returns_once_pending_saves_committed(tmp_path, closing, gated):
    acc = make_accelerator(tmp_path / "project")
    storage = gated(tmp_path / "project" / "checkpoints")
    _enable(acc, closing, storage=storage)
    setup = Setup(acc)
    setup.step()
    expected = setup.snapshot()
    storage.gate.clear()
    folder = acc.save_state()

    def open_gate_once_writing() -> None:
        assert storage.write_started.wait(30)
        storage.gate.set()

    opener = threading.Thread(target=open_gate_once_writing, name="test-gate")
    opener.start()
    acc.wait_for_everyone()  # the user's pattern before copying or uploading the folder
    assert os.path.exists(os.path.join(folder, MANIFEST)) and not os.path.exists(os.path.join(folder, PENDING))
    opener.join(30)
    copy = str(tmp_path / "copy")
    shutil.copytree(folder, copy)
    setup.step()
    acc.load_state(copy)
    assert_same(expected, setup.snapshot())


def test_removing_the_folder_right_after_save_state_wins(tmp_path, closing, caplog):
    """A TemporaryDirectory cleanup and a removed project folder, 10 trials each: nothing raises, nothing is
    recreated, and the abandoned saves are reported once (a warning), not as errors."""
    caplog.set_level(logging.INFO, logger="fastckpt")
    for trial in range(10):
        project = tempfile.mkdtemp(dir=tmp_path)
        acc = make_accelerator(project, automatic=False)
        checkpointing = _enable(acc, closing, config={"root": os.path.join(project, "checkpoints")})
        setup = Setup(acc, width=128)
        setup.step()
        with tempfile.TemporaryDirectory(dir=tmp_path) as scratch:
            acc.save_state(scratch)
        assert not os.path.exists(scratch)
        setup.step()
        acc.save_state(os.path.join(project, "run", "latest"))
        shutil.rmtree(project)  # a cleanup script, right after the save
        acc.wait_for_everyone()
        acc.end_training()  # a lost folder is the user's choice, not a failure
        assert checkpointing.closed
        assert not os.path.exists(scratch) and not os.path.exists(project), f"trial {trial}: recreated"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[0].getMessage()
    warned = [r.getMessage().split()[1] for r in caplog.records
              if r.levelno == logging.WARNING and "removed" in r.getMessage()]
    assert warned and len(warned) == len(set(warned))  # each abandoned save says so once, whatever its files


def test_a_removed_folder_is_not_recreated_by_a_writer_already_past_its_check(tmp_path, closing, gated, caplog):
    """The writer is held inside its write (past every check) while the folder is removed: whatever a storage's
    makedirs recreates is removed again, the save's own handle says why, and nothing is raised later."""
    project = tmp_path / "project"
    acc = make_accelerator(project)
    storage = gated(project / "checkpoints")
    checkpointing = _enable(acc, closing, storage=storage)
    setup = Setup(acc)
    setup.step()
    storage.gate.clear()
    folder = acc.save_state()
    checkpointing.checkpointer.wait_staged()  # the seal: Accelerate's files are written from then on
    assert storage.write_started.wait(30)
    shutil.rmtree(folder)
    caplog.set_level(logging.INFO, logger="fastckpt")
    storage.gate.set()
    with pytest.raises(FolderRemovedError, match="removed"):
        checkpointing.last_handle.wait()
    assert not os.path.exists(folder)
    acc.wait_for_everyone()  # quiet: the removal was the user's
    setup.step()
    second = acc.save_state()  # the run goes on
    acc.wait_for_everyone()
    assert os.path.exists(os.path.join(second, MANIFEST))
    assert sum("removed" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1


def test_saving_one_folder_again_shows_the_latest_save_only(tmp_path, closing):
    """The second save_state of a folder whose first save is still being written waits for it, then marks the
    folder: a reader never takes the first save's manifest for the second's checkpoint."""
    acc = make_accelerator(tmp_path / "project", automatic=False)
    root = tmp_path / "project" / "checkpoints"
    storage = OneSaveAtATime(str(root))
    _enable(acc, closing, config={"root": str(root)}, storage=storage)
    setup = Setup(acc)
    target = str(root / "latest")
    setup.step()
    storage.gate.clear()
    acc.save_state(target)

    def open_gate_once_writing() -> None:
        assert storage.write_started.wait(30)
        storage.gate.set()

    opener = threading.Thread(target=open_gate_once_writing, name="test-gate")
    opener.start()
    setup.step()
    expected = setup.snapshot()
    acc.save_state(target)  # waits for the first save of this folder, then marks it again
    opener.join(30)
    assert not os.path.exists(os.path.join(target, MANIFEST))  # the first save's manifest is not taken for this one
    assert os.path.exists(os.path.join(target, PENDING))
    storage.gate.set()
    acc.wait_for_everyone()
    setup.step()
    acc.load_state(target)
    assert_same(expected, setup.snapshot())
