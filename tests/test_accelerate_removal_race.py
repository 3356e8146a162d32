"""A user's ``rmtree`` of the project right after ``save_state()`` races the background writes (issue 23, item 14).

Python's ``rmtree`` lists a folder, unlinks what it listed, then removes the folder: a name the background save
creates in between makes it fail with "Directory not empty". So a made folder holds only its marker until every
member file is complete (written unnamed), then every name appears at once, the manifest last; the marker checked
before each name. These tests pin that down, then run the pattern of Accelerate's own ``test_checkpoint_deletion``
(eleven saves, ``total_limit=2``, a ``TemporaryDirectory`` exit right after the last) in a loop of trials.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
from collections import Counter
from typing import Any

import pytest

import fastckpt.format.bundle as bundle
import fastckpt_accelerate
from accelerate_testing import Setup, assert_same, closing, make_accelerator, rmtree_trials  # noqa: F401 (closing: a fixture)
from fastckpt.errors import FolderRemovedError
from fastckpt.format.bundle import PENDING
from fastckpt.format.layout import MANIFEST

pytestmark = pytest.mark.timeout(120)


def test_member_files_appear_only_once_all_are_written(tmp_path, closing, monkeypatch):
    """While any member's bytes are being checksummed (the last step before it is written), the folder lists only
    the marker: a user's rmtree listing it then removes everything there is. The checkpoint still loads back."""
    acc = make_accelerator(tmp_path / "project")
    closing.append(fastckpt_accelerate.enable(acc))
    setup = Setup(acc)
    setup.step()
    seen: list[list[str]] = []
    crc32c = bundle.crc32c
    folder: list[str] = []

    def watching(data: Any, crc: int = 0) -> int:
        if folder:
            seen.append(sorted(os.listdir(folder[0])))
        return crc32c(data, crc)

    monkeypatch.setattr(bundle, "crc32c", watching)
    expected = setup.snapshot()
    folder.append(os.path.join(str(tmp_path / "project" / "checkpoints"), "checkpoint_0"))
    assert acc.save_state() == folder[0]
    acc.wait_for_everyone()
    assert len(seen) >= 4, seen  # model, optimizer, scheduler, sampler, RNG files: several members
    assert all(listing == [PENDING] for listing in seen), seen
    assert MANIFEST in os.listdir(folder[0]) and PENDING not in os.listdir(folder[0])
    setup.step()
    acc.load_state(folder[0])
    assert_same(expected, setup.snapshot())


def test_a_temporary_project_removed_right_after_the_last_save_wins(tmp_path, closing, caplog):
    """Accelerate's test_checkpoint_deletion pattern, 20 trials: eleven saves (two staging slots: the last ones
    still pending), then the TemporaryDirectory's exit. Its cleanup never fails, nothing is recreated, no error is
    logged, and each abandoned save says so once."""
    caplog.set_level(logging.INFO, logger="fastckpt")
    for trial in range(20):
        with tempfile.TemporaryDirectory(dir=tmp_path) as project:
            acc = make_accelerator(project, total_limit=2)
            checkpointing = fastckpt_accelerate.enable(acc)
            closing.append(checkpointing)
            setup = Setup(acc, seed=trial)
            for _ in range(11):
                acc.save_state()
            assert os.path.isdir(os.path.join(project, "checkpoints", "checkpoint_10"))
        acc.wait_for_everyone()
        acc.end_training()
        assert not os.path.exists(project), f"trial {trial}: {project} recreated"
        del setup
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[0]
    warned = Counter(r.getMessage() for r in caplog.records
                     if r.levelno == logging.WARNING and "removed" in r.getMessage())
    assert all(n == 1 for n in warned.values()), warned


def test_a_removal_that_listed_the_folder_wins_over_the_links(tmp_path, closing, monkeypatch, caplog):
    """A walker (what shutil.rmtree does) opens and lists the folder while only the marker is there, then the
    save's names would be linked: they wait until the walker closed the folder, so its unlinks and its rmdir of
    what it listed succeed, and the save gives up quietly (one warning, no error, nothing recreated)."""
    caplog.set_level(logging.INFO, logger="fastckpt")
    acc = make_accelerator(tmp_path / "project")
    checkpointing = fastckpt_accelerate.enable(acc)
    closing.append(checkpointing)
    setup = Setup(acc)
    setup.step()
    folder = str(tmp_path / "project" / "checkpoints" / "checkpoint_0")
    crc32c, calls, outcome, walkers = bundle.crc32c, [], {}, []

    def walk(fd: int, listed: list[str]) -> None:
        # As rmtree: the folder stays open from its listing until right before its rmdir. Given the time to link
        # (a writer that does not wait links and commits at once), then removes what it listed.
        concurrent.futures.wait([checkpointing.last_handle.durable], timeout=0.5)
        for name in listed:
            os.unlink(name, dir_fd=fd)
        os.close(fd)
        try:
            os.rmdir(folder)
        except OSError as e:
            outcome["error"] = e

    def listing_once_staged(data: Any, crc: int = 0) -> int:
        calls.append(None)
        if len(calls) == total[0]:  # the last member's bytes: every member is written unnamed right after
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            listed = os.listdir(fd)
            assert listed == [PENDING]
            walkers.append(threading.Thread(target=walk, args=(fd, listed), name="test-walker"))
            walkers[0].start()
        return crc32c(data, crc)

    total = [0]
    monkeypatch.setattr(bundle, "crc32c", lambda data, crc=0: (calls.append(None), crc32c(data, crc))[1])
    acc.save_state()  # a first save only counts the checksummed parts of this state
    acc.wait_for_everyone()
    total[0], calls[:] = len(calls), []
    shutil.rmtree(tmp_path / "project" / "checkpoints")
    acc.project_configuration.iteration = 0
    monkeypatch.setattr(bundle, "crc32c", listing_once_staged)
    assert acc.save_state() == folder
    with pytest.raises(FolderRemovedError):
        checkpointing.last_handle.wait()
    walkers[0].join(30)
    assert "error" not in outcome, outcome
    assert not os.path.exists(folder)
    acc.wait_for_everyone()  # quiet: the removal was the user's
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert sum("removed" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING) == 1


def test_rmtree_of_the_project_right_after_save_state_never_meets_retention(tmp_path, closing, caplog):
    """Issue 54, item 14: ``total_limit=2``, then a plain ``shutil.rmtree(project_dir)`` (no
    ``TemporaryDirectory``, which swallows ``FileNotFoundError``) right after the last ``save_state()``, 20 trials.
    fastckpt's retention deletes the old folders in the background once a save commits; stock's runs inside
    ``save_state()``. The user's removal must win every time: no ``FileNotFoundError`` from a file or folder
    retention removed under the walk, nothing recreated, no error logged."""
    rmtree_trials(tmp_path, lambda acc: closing.append(fastckpt_accelerate.enable(acc)), caplog)


def test_a_removal_that_listed_the_folder_after_the_links_meets_no_missing_marker(tmp_path, closing, monkeypatch,
                                                                                  caplog):
    """The flake of the 20-trial loop above, replayed every time: a walker (rmtree) opens and lists the folder
    after every name is linked but before the marker is removed, so it lists the marker too. The marker's removal
    waits while the walker holds the folder open (as the links do); the walker's unlinks of what it listed all
    succeed. Before: the committer unlinked the marker under the walk and the walker's unlink of it raised
    FileNotFoundError ('.fastckpt-pending')."""
    from fastckpt.storage.local import LocalStorage

    caplog.set_level(logging.INFO, logger="fastckpt")
    acc = make_accelerator(tmp_path / "project")
    checkpointing = fastckpt_accelerate.enable(acc)
    closing.append(checkpointing)
    Setup(acc).step()
    folder = str(tmp_path / "project" / "checkpoints" / "checkpoint_0")
    outcome: dict[str, Any] = {}
    walkers: list[threading.Thread] = []
    link = LocalStorage.link_unnamed

    def walk(fd: int, listed: list[str]) -> None:
        # rmtree's order: the folder open from its listing to right before its rmdir; given the time a writer that
        # does not wait needs to remove the marker, then removes what it listed
        concurrent.futures.wait([checkpointing.last_handle.durable], timeout=0.5)
        try:
            for name in listed:
                os.unlink(name, dir_fd=fd)
            os.close(fd)
            os.rmdir(folder)
        except OSError as e:
            outcome["error"] = e

    def linking_then_listed(self, fd, path, *args, **kwargs):
        out = link(self, fd, path, *args, **kwargs)
        if os.path.basename(path) == MANIFEST:  # every name is there, the marker too: a walk lists them all now
            held = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            listed = os.listdir(held)
            outcome["listed"] = sorted(listed)
            walkers.append(threading.Thread(target=walk, args=(held, listed), name="test-walker"))
            walkers[0].start()
        return out

    monkeypatch.setattr(LocalStorage, "link_unnamed", linking_then_listed)
    assert acc.save_state() == folder
    checkpointing.last_handle.wait(timeout=60)  # committed before the removal: the save itself succeeded
    walkers[0].join(30)
    assert PENDING in outcome["listed"] and MANIFEST in outcome["listed"], outcome
    assert "error" not in outcome, outcome
    assert not os.path.exists(folder)
    acc.wait_for_everyone()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
