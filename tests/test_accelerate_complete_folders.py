"""``enable(..., complete_folders=True)`` (issue 55, item 5): a copy of the folder right after ``save_state()`` gets the
complete checkpoint or fails loudly, never the marker alone.

By default the folder exists once ``save_state()`` returns, as in stock Accelerate (whose own
``test_checkpoint_deletion`` checks ``os.path.exists`` right after the call), and holds only ``.fastckpt-pending``
until the commit: ``shutil.copytree`` and ``cp -r`` then copy the marker without an error
(tests/test_accelerate_user_saves.py). With ``complete_folders`` a new folder is written under a hidden sibling name
and renamed into place at its commit. These tests copy right after ``save_state()`` in loops (and once with the
commit held back, so that the early copy is certain), run the removal races of tests/test_accelerate_removal_race.py
with the option on, and SIGKILL a saving process: what a later run sees never counts or loads a partial folder.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

import fastckpt.format.bundle as bundle
import fastckpt_accelerate
from accelerate_testing import (GatedStorage, Setup, assert_same, closing, fresh_accelerate,  # noqa: F401 (fixtures)
                                make_accelerator, reset_accelerate, rmtree_trials)
from fastckpt.errors import ConfigError, FolderRemovedError, StorageError
from fastckpt.format.bundle import PENDING, staging_path
from fastckpt.format.layout import MANIFEST
from fastckpt.read.verify import verify_checkpoint
from fastckpt.storage.local import LocalStorage

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]


def _enable(acc: Any, closing: list, **kwargs: Any) -> Any:
    checkpointing = fastckpt_accelerate.enable(acc, complete_folders=True, **kwargs)
    closing.append(checkpointing)
    return checkpointing


def _assert_complete(copy: str) -> None:
    """A copied folder holds the committed checkpoint: its manifest, every file it lists (checked against it), no
    marker, nothing else of fastckpt's."""
    names = set(os.listdir(copy))
    assert MANIFEST in names and PENDING not in names, sorted(names)
    assert verify_checkpoint(LocalStorage(copy), copy)[1] == []


def _copy_now(folder: str, copy: str) -> str:
    """``shutil.copytree`` of ``folder`` right now: "failed" (loud) or "complete" (checked); never anything else."""
    try:
        shutil.copytree(folder, copy)
    except FileNotFoundError:
        assert not os.path.exists(copy)
        return "failed"
    _assert_complete(copy)
    return "complete"


def _cp_now(folder: str, copy: str) -> str:
    """``cp -r`` of ``folder`` right now: a non-zero exit naming the missing folder, or a complete copy."""
    done = subprocess.run(["cp", "-r", folder, copy], capture_output=True, text=True)
    if done.returncode != 0:
        assert "No such file or directory" in done.stderr, done.stderr
        assert not os.path.exists(copy)
        return "failed"
    _assert_complete(copy)
    return "complete"


def test_a_copy_held_before_the_commit_fails_instead_of_copying_the_marker(tmp_path, closing):
    """The commit held back: the folder's name does not exist yet, so copytree and cp -r fail loudly (by default
    both copy the marker alone, with no error); the hidden staging folder is what holds the save meanwhile."""
    acc = make_accelerator(tmp_path / "project")
    storage = GatedStorage(str(tmp_path / "project" / "checkpoints"))
    _enable(acc, closing, storage=storage)
    setup = Setup(acc)
    setup.step()
    expected = setup.snapshot()
    storage.gate.clear()
    try:
        folder = acc.save_state()
        assert not os.path.exists(folder)
        assert os.path.isdir(staging_path(folder))
        with pytest.raises(FileNotFoundError):
            shutil.copytree(folder, str(tmp_path / "copytree"))
        assert _cp_now(folder, str(tmp_path / "cp")) == "failed"
    finally:
        storage.gate.set()
    acc.wait_for_everyone()
    assert sorted(os.listdir(os.path.dirname(folder))) == [os.path.basename(folder)]  # staging renamed, no marker
    assert _copy_now(folder, str(tmp_path / "copytree")) == "complete"
    assert _cp_now(folder, str(tmp_path / "cp")) == "complete"
    setup.step()
    acc.load_state(str(tmp_path / "cp"))
    assert_same(expected, setup.snapshot())


def test_copies_right_after_save_state_are_complete_or_fail_20_trials(tmp_path, closing):
    """20 trials of save_state() then, at once, copytree and cp -r of the returned folder (automatic naming, a
    ~7 MB checkpoint): each copy is complete or fails loudly; after wait_for_everyone() both are complete and load
    back bit for bit."""
    acc = make_accelerator(tmp_path / "project", total_limit=3)
    _enable(acc, closing, config={"persist": {"fsync": False}})
    setup = Setup(acc, width=768)
    outcomes: list[str] = []
    for trial in range(20):
        setup.step()
        expected = setup.snapshot()
        folder = acc.save_state()
        outcomes.append(_copy_now(folder, str(tmp_path / f"copytree-{trial}")))
        outcomes.append(_cp_now(folder, str(tmp_path / f"cp-{trial}")))
        acc.wait_for_everyone()
        for copy in (f"copytree-{trial}", f"cp-{trial}"):
            shutil.rmtree(tmp_path / copy, ignore_errors=True)
            _copy_now(folder, str(tmp_path / copy))
        if trial % 5 == 4:
            setup.step()
            acc.load_state(str(tmp_path / f"cp-{trial}"))
            assert_same(expected, setup.snapshot())
    assert set(outcomes) <= {"failed", "complete"} and len(outcomes) == 40


def test_a_temporary_project_removed_right_after_the_last_save_wins(tmp_path, closing, caplog):
    """Accelerate's test_checkpoint_deletion pattern (eleven saves, total_limit=2, the TemporaryDirectory's exit
    right after the last), 20 trials with complete_folders: the cleanup never fails, nothing is recreated (neither
    the project nor a staging folder), no error is logged."""
    caplog.set_level(logging.INFO, logger="fastckpt")
    for trial in range(20):
        with tempfile.TemporaryDirectory(dir=tmp_path) as project:
            acc = make_accelerator(project, total_limit=2)
            _enable(acc, closing)
            setup = Setup(acc, seed=trial)
            for _ in range(11):
                folder = acc.save_state()
            for last in (folder, folder[:-2] + "9"):  # visible under their own names only once committed (older
                # ones may be half deleted by retention right now)
                assert not os.path.exists(last) or os.path.exists(os.path.join(last, MANIFEST)), last
        acc.wait_for_everyone()
        acc.end_training()
        assert not os.path.exists(project), f"trial {trial}: {project} recreated"
        del setup
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[0]


def test_rmtree_of_the_project_right_after_save_state_wins_20_trials(tmp_path, closing, caplog):
    """A plain shutil.rmtree(project_dir) right after the last of six saves (total_limit=2: retention deletes in the
    background), 20 trials: the rename into place never meets the walk (no FileNotFoundError, no "Directory not
    empty"), nothing is recreated, no error is logged."""
    rmtree_trials(tmp_path, lambda acc: _enable(acc, closing), caplog)


def test_a_removal_that_listed_the_parent_wins_over_the_rename(tmp_path, closing, monkeypatch, caplog):
    """A walker (what shutil.rmtree does) opens and lists the checkpoints folder while the save is staged: the
    rename into place waits while it holds the folder open (a name vanishing from its listing, or appearing, would
    fail its removal); the walker removes what it listed and the folder itself without an error, and the save gives
    up quietly: its own handle says so, one warning, nothing recreated."""
    caplog.set_level(logging.INFO, logger="fastckpt")
    acc = make_accelerator(tmp_path / "project")
    checkpointing = _enable(acc, closing)
    setup = Setup(acc)
    setup.step()
    parent = str(tmp_path / "project" / "checkpoints")
    folder = os.path.join(parent, "checkpoint_0")
    crc32c, calls, outcome, walkers = bundle.crc32c, [], {}, []

    def walk(fd: int, listed: list[str]) -> None:
        # As rmtree: the parent stays open from its listing until right before its rmdir. Given the time to rename
        # (a writer that does not wait renames at once), then removes what it listed.
        concurrent.futures.wait([checkpointing.last_handle.durable], timeout=0.5)
        outcome["waited"] = not checkpointing.last_handle.durable.done()
        try:
            for name in listed:
                shutil.rmtree(os.path.join(parent, name))
            os.close(fd)
            os.rmdir(parent)
        except OSError as e:
            outcome["error"] = e

    def listing_once_staged(data: Any, crc: int = 0) -> int:
        calls.append(None)
        if len(calls) == total[0]:  # the last member's bytes: the links and the rename follow
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
            listed = os.listdir(fd)
            assert listed == [os.path.basename(staging_path(folder))], listed
            walkers.append(threading.Thread(target=walk, args=(fd, listed), name="test-walker"))
            walkers[0].start()
        return crc32c(data, crc)

    total = [0]
    monkeypatch.setattr(bundle, "crc32c", lambda data, crc=0: (calls.append(None), crc32c(data, crc))[1])
    acc.save_state()  # a first save only counts the checksummed parts of this state
    acc.wait_for_everyone()
    total[0], calls[:] = len(calls), []
    shutil.rmtree(parent)
    acc.project_configuration.iteration = 0
    monkeypatch.setattr(bundle, "crc32c", listing_once_staged)
    assert acc.save_state() == folder
    with pytest.raises(FolderRemovedError):
        checkpointing.last_handle.wait()
    walkers[0].join(30)
    assert outcome.get("waited") is True, "the rename did not wait for the walk"
    assert "error" not in outcome, outcome
    assert not os.path.exists(parent)
    acc.wait_for_everyone()  # quiet: the removal was the user's
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert sum("removed" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1


def test_pre_hook_files_appear_with_the_folder_and_an_existing_folder_is_written_in_place(tmp_path, closing):
    """A register_save_state_pre_hook writes into the staging folder (it appears, with the hook's files, at the
    commit); a folder that exists already (an output_dir saved again) is written in place, as without the option,
    its other files kept."""
    acc = make_accelerator(tmp_path / "project", automatic=False)
    _enable(acc, closing, config={"root": str(tmp_path / "project" / "checkpoints")})
    seen: list[str] = []

    def hook(models: Any, weights: Any, output_dir: str) -> None:
        seen.append(output_dir)
        with open(os.path.join(output_dir, "adapter.json"), "w") as f:
            f.write("{}")

    acc.register_save_state_pre_hook(hook)
    Setup(acc).step()
    target = str(tmp_path / "out" / "latest")
    assert acc.save_state(target) == target
    assert seen == [staging_path(target)]
    acc.wait_for_everyone()
    assert {"adapter.json", MANIFEST} <= set(os.listdir(target)) and PENDING not in os.listdir(target)
    with open(os.path.join(target, "notes.txt"), "w") as f:
        f.write("mine")
    acc.save_state(target)  # exists now: written in place, the user's file kept
    assert seen[-1] == target
    acc.wait_for_everyone()
    assert {"adapter.json", "notes.txt", MANIFEST} <= set(os.listdir(target))
    assert not os.path.exists(staging_path(target))


def test_a_folder_made_under_the_name_before_the_commit_fails_the_save_loudly(tmp_path, closing):
    """The user creates the folder (and a file in it) while its save is staged: the rename cannot take the name;
    the save fails at the next wait, naming the staged folder, which keeps the checkpoint."""
    acc = make_accelerator(tmp_path / "project")
    storage = GatedStorage(str(tmp_path / "project" / "checkpoints"))
    _enable(acc, closing, storage=storage)
    Setup(acc).step()
    storage.gate.clear()
    folder = acc.save_state()
    os.makedirs(folder)
    with open(os.path.join(folder, "mine.txt"), "w") as f:
        f.write("mine")
    storage.gate.set()
    with pytest.raises(StorageError, match=re.escape(staging_path(folder)) + ".*cannot take its name"):
        acc.wait_for_everyone()
    assert os.listdir(folder) == ["mine.txt"]
    assert MANIFEST in os.listdir(staging_path(folder))


@pytest.mark.filterwarnings("ignore:fastckpt's root")  # the root is refused anyway
def test_complete_folders_is_refused_where_no_folder_can_be_renamed(tmp_path):
    acc = make_accelerator(tmp_path / "project")
    with pytest.raises(ConfigError, match="complete_folders=True needs a local root"):
        fastckpt_accelerate.enable(acc, {"root": "memory://run"}, complete_folders=True)
    with pytest.raises(ConfigError, match="shared_writes=True"):
        fastckpt_accelerate.enable(acc, complete_folders=True, shared_writes=True)


_KILLED_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests"]
    import fastckpt_accelerate
    from accelerate_testing import Setup, rmtree_trials, make_accelerator
    acc = make_accelerator(sys.argv[1], total_limit=2)
    checkpointing = fastckpt_accelerate.enable(acc, {"persist": {"fsync": False}}, complete_folders=True)
    setup = Setup(acc, width=768)  # ~2.4 MB of weights, ~7 MB per checkpoint with AdamW's state
    for i in range(1000):
        setup.step()
        acc.save_state()
        if i == 0:
            checkpointing.wait()  # one good checkpoint before the kill
        print(f"saved {i}", flush=True)
""")


def _stock_pick(root: Path) -> str:
    """The folder stock Accelerate's ``load_state()`` (and its total_limit) takes for the newest: the largest first
    number in each entry's name (accelerator.py's ``_inner``), over every entry of the folder."""
    return max(os.listdir(root), key=lambda n: int(re.findall(r"[0-9]+", n)[0]))


@pytest.mark.parametrize("trial", range(3))
def test_sigkill_mid_save_leaves_nothing_a_later_run_counts_or_loads(tmp_path, closing, trial):
    """A process saving with complete_folders is SIGKILLed right after a save_state() returned (its save in flight),
    3 trials: every folder under its own name is committed and verifies; a leftover staging folder is not listed,
    not counted by total_limit, not loaded (by fastckpt, nor taken for the newest by stock Accelerate's ordering),
    and the resumed run's next save of that name removes it."""
    child = tmp_path / "child.py"
    child.write_text(_KILLED_CHILD)
    proc = subprocess.Popen([sys.executable, str(child), str(tmp_path), str(REPO)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for _ in range(2 + trial):
            line = proc.stdout.readline()
            assert line.startswith("saved"), line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    root = tmp_path / "checkpoints"
    visible = [n for n in os.listdir(root) if not n.startswith(".")]
    for name in visible:
        assert verify_checkpoint(LocalStorage(str(root / name)), str(root / name))[1] == [], name
    newest = max(visible, key=lambda n: int(n.split("_")[1]))
    assert not _stock_pick(root).startswith(".")  # a leftover sorts oldest for stock Accelerate
    reset_accelerate()
    acc = make_accelerator(tmp_path, total_limit=2)
    checkpointing = _enable(acc, closing)
    setup = Setup(acc, width=768)
    assert [i.name for i in checkpointing.list()] == sorted(visible, key=lambda n: int(n.split("_")[1]))
    assert acc.load_state() == str(root / newest)
    assert setup.counter.value == int(newest.split("_")[1]) + 1
    leftover = staging_path(str(root / f"checkpoint_{int(newest.split('_')[1]) + 1}"))
    setup.step()
    folder = acc.save_state()  # the name the killed save had
    acc.wait_for_everyone()
    assert not os.path.exists(leftover) and os.path.exists(os.path.join(folder, MANIFEST))
    assert len([n for n in os.listdir(root) if not n.startswith(".")]) == 2  # total_limit, leftovers not counted
