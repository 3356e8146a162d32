"""A user's ``rmtree`` of the project right after ``save_state()`` races the background writes (issue 23, item 14).

Python's ``rmtree`` lists a folder, unlinks what it listed, then removes the folder: a name the background save
creates in between makes it fail with "Directory not empty". So a made folder holds only its marker until every
member file is complete (written unnamed), then every name appears at once, the manifest last; the marker checked
before each name. These tests pin that down, then run the pattern of Accelerate's own ``test_checkpoint_deletion``
(eleven saves, ``total_limit=2``, a ``TemporaryDirectory`` exit right after the last) in a loop of trials.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections import Counter
from typing import Any

import pytest

import fastckpt.format.bundle as bundle
import fastckpt_accelerate
from accelerate_testing import Setup, assert_same, closing, make_accelerator  # noqa: F401 (closing: a fixture)
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
