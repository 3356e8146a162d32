"""Health of every checkpoint with Accelerate (issue 25, item 2): a run that turns NaN at save N resumes from the
folder before it through ``load_state(healthy=True)``; stock ``load_state`` reads the folders unchanged."""
from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt_accelerate
from accelerate_testing import Setup, assert_same, closing, fresh_accelerate, make_accelerator  # noqa: F401

pytestmark = pytest.mark.timeout(120)

NAN_AT = 3


def test_nan_at_save_n_latest_healthy_is_the_folder_before(tmp_path, closing) -> None:  # noqa: F811
    acc = make_accelerator(tmp_path)
    checkpointing = fastckpt_accelerate.enable(acc)
    closing.append(checkpointing)
    setup = Setup(acc)
    snapshots = []
    for i in range(5):
        setup.step()
        if i >= NAN_AT:
            with torch.no_grad():
                acc.unwrap_model(setup.model)[0].weight[0, 0] = float("nan")
        snapshots.append(setup.snapshot())
        acc.save_state()
    checkpointing.wait()
    infos = checkpointing.list()
    assert [i.healthy for i in infos] == [True, True, True, False, False]
    assert checkpointing.latest(healthy=True) == infos[NAN_AT - 1].step
    assert checkpointing.latest() == infos[-1].step
    folder = os.path.join(str(tmp_path), "checkpoints", f"checkpoint_{NAN_AT}")
    health = json.loads(open(os.path.join(folder, "manifest.json")).read())["health"]
    assert health["healthy"] is False and health["nan"] == 1

    for _ in range(2):
        setup.step()
    assert acc.load_state(healthy=True) == infos[NAN_AT - 1].path
    after = setup.snapshot()
    expected = snapshots[NAN_AT - 1]
    for key in ("model", "optimizer", "scheduler", "counter"):
        assert_same(expected[key], after[key])


def test_stock_load_state_reads_a_folder_with_health(tmp_path, closing) -> None:  # noqa: F811
    acc = make_accelerator(tmp_path)
    checkpointing = fastckpt_accelerate.enable(acc)
    closing.append(checkpointing)
    setup = Setup(acc)
    setup.step()
    expected = setup.snapshot()
    path = acc.save_state()
    checkpointing.close()
    assert "health" in json.loads(open(os.path.join(path, "manifest.json")).read())

    plain = make_accelerator(tmp_path / "plain")  # stock Accelerate, never enabled
    other = Setup(plain, seed=1)
    plain.load_state(path)
    after = other.snapshot()
    for key in ("model", "optimizer", "scheduler"):
        assert_same(expected[key], after[key])


def test_total_limit_never_removes_the_newest_healthy_folder(tmp_path, closing) -> None:  # noqa: F811
    acc = make_accelerator(tmp_path, total_limit=2)
    checkpointing = fastckpt_accelerate.enable(acc)
    closing.append(checkpointing)
    setup = Setup(acc)
    for i in range(6):
        setup.step()
        if i >= NAN_AT:
            with torch.no_grad():
                acc.unwrap_model(setup.model)[0].weight[0, 0] = float("nan")
        acc.save_state()
    checkpointing.wait()
    names = [os.path.basename(i.path) for i in checkpointing.list()]
    assert names == [f"checkpoint_{NAN_AT - 1}", "checkpoint_4", "checkpoint_5"]
