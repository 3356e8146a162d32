"""Where Accelerate's automatic checkpoints go when the fastckpt config names a ``root`` and the Accelerator a
``project_dir`` (issue 55, item 3): the root wins, and one warning says so, as the Lightning plugin says when its
``root`` and a ``ModelCheckpoint``'s ``dirpath`` differ. Where they agree, or only one is given, nothing is said."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import fastckpt_accelerate
from accelerate_testing import closing, reset_accelerate  # noqa: F401 (closing: a fixture)

pytestmark = pytest.mark.timeout(120)


def _save_once(project_dir: str | None, config: dict, closing: list, automatic: bool = True) -> tuple[str, list]:
    reset_accelerate()
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=project_dir, automatic_checkpoint_naming=automatic))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        closing.append(fastckpt_accelerate.enable(accelerator, config))
    accelerator.prepare(torch.nn.Linear(4, 2))
    folder = accelerator.save_state()
    accelerator.end_training()
    return folder, [w for w in caught if "fastckpt" in str(w.message)]


def test_a_root_elsewhere_than_project_dir_is_said_once_and_wins(tmp_path, closing, monkeypatch):
    """The README's pair before the fix: ``project_dir="runs/x"`` and ``root: checkpoints/run1``. The checkpoint
    lands under the root (as before), ``runs/x`` is never created, and one warning names both places and the fix.
    Before: silence."""
    monkeypatch.chdir(tmp_path)
    folder, warned = _save_once("runs/x", {"root": "checkpoints/run1"}, closing)
    assert folder == str(tmp_path / "checkpoints" / "run1" / "checkpoint_0")
    assert (Path(folder) / "manifest.json").is_file() and not (tmp_path / "runs").exists()
    assert len(warned) == 1, [str(w.message) for w in warned]
    message = str(warned[0].message)
    assert issubclass(warned[0].category, UserWarning)
    assert "project_dir='runs/x'" in message and str(tmp_path / "checkpoints" / "run1") in message
    assert str(tmp_path / "runs" / "x" / "checkpoints") in message and "Leave root out" in message
    assert warned[0].filename == __file__  # points at the enable() call


@pytest.mark.parametrize("case", ["same root, spelled otherwise", "no root", "no project_dir", "no automatic naming"])
def test_nothing_is_said_where_only_one_place_is_named(tmp_path, closing, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    project, config, automatic = {
        "same root, spelled otherwise": ("runs/x", {"root": f"{tmp_path}/runs/./x/checkpoints/"}, True),
        "no root": ("runs/x", {}, True),
        "no project_dir": (None, {"root": "checkpoints/run1"}, True),
        "no automatic naming": ("runs/x", {"root": "checkpoints/run1"}, False),
    }[case]
    if automatic:
        folder, warned = _save_once(project, config, closing)
        expected = tmp_path / ("checkpoints/run1" if project is None else "runs/x/checkpoints") / "checkpoint_0"
        assert folder == str(expected)
    else:
        reset_accelerate()
        accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=project))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            closing.append(fastckpt_accelerate.enable(accelerator, config))
        warned = [w for w in caught if "fastckpt" in str(w.message)]
    assert warned == [], [str(w.message) for w in warned]


def test_the_shm_warning_points_at_the_enable_call_too(tmp_path, closing, monkeypatch):
    """The other warning config.py gives (``staging.shm: true`` ignored) names the user's line, not a frame of
    fastckpt_accelerate: its fixed ``stacklevel`` was off by one once a wrapper was added."""
    monkeypatch.chdir(tmp_path)
    _, warned = _save_once(None, {"root": str(tmp_path / "c"), "staging": {"shm": True}}, closing, automatic=False)
    shm = [w for w in warned if "staging.shm" in str(w.message)]
    assert len(shm) == 1 and shm[0].filename == __file__, [(str(w.message), w.filename) for w in warned]
