"""``fastckpt_accelerate.should_checkpoint``: the loop calls ``save_state()`` at the cadence the core chose."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import fastckpt_accelerate
from accelerate_testing import Setup, closing, fresh_accelerate, make_accelerator  # noqa: F401 (fixtures)
from fastckpt.errors import ConfigError
from fastckpt.tiers.runs import RUNS_NAME
from tests.helpers import assert_bit_equal

pytestmark = pytest.mark.timeout(120)


def test_auto_calls_save_state_at_the_chosen_cadence(tmp_path, closing) -> None:
    acc = make_accelerator(tmp_path)
    config = {"persist": {"fsync": False},
              "cadence": {"interval": "auto", "mtbf_s": 0.02, "min_interval_s": 0.0, "baseline_interval": 50}}
    checkpointing = fastckpt_accelerate.enable(acc, config)
    closing.append(checkpointing)
    setup = Setup(acc)
    saves: list[tuple[int, int | None]] = []
    weights = {}
    # Until five saves, not a fixed number of steps: the plan is sqrt(2 * cost * MTBF) / step time, and on a loaded
    # machine a save's measured cost grows against the tiny step (CI once made 3 saves in 40 steps).
    for step in range(1, 2001):
        setup.step()
        if fastckpt_accelerate.should_checkpoint(acc, step):
            acc.save_state()
            saves.append((step, fastckpt_accelerate.cadence_stats(acc).interval_steps))
            weights[step] = {k: v.clone() for k, v in acc.unwrap_model(setup.model).state_dict().items()}
            if len(saves) == 5:
                break
    checkpointing.wait()
    st = fastckpt_accelerate.cadence_stats(acc)
    assert st.mode == "auto" and st.saves_measured >= 2 and st.cost_s > 0
    assert st.baseline_loss_s == pytest.approx(50 * st.step_s / 2)
    assert len(saves) == 5, saves
    # each gap is the interval chosen at the save before it (from the second plan on: the first had no cost)
    assert [b[0] - a[0] for a, b in zip(saves[1:], saves[2:])] == [p for _, p in saves[1:-1]]
    assert len(checkpointing.list()) == len(saves)
    last = checkpointing.list()[-1]
    model = load_file(str(tmp_path / "checkpoints" / last.name / "model.safetensors"))
    assert_bit_equal(dict(sorted(model.items())), dict(sorted(weights[saves[-1][0]].items())))


def test_every_n_steps_and_the_record_of_runs(tmp_path, closing) -> None:
    acc = make_accelerator(tmp_path)
    checkpointing = fastckpt_accelerate.enable(acc, {"cadence": {"interval": 4}, "persist": {"fsync": False}})
    closing.append(checkpointing)
    assert [s for s in range(1, 14) if fastckpt_accelerate.should_checkpoint(acc, s)] == [4, 8, 12]
    assert not (tmp_path / "checkpoints" / RUNS_NAME).exists()  # a fixed cadence needs no MTBF

    acc = make_accelerator(tmp_path / "auto")
    checkpointing = fastckpt_accelerate.enable(acc, {"cadence": {"interval": "auto"}})
    closing.append(checkpointing)
    fastckpt_accelerate.should_checkpoint(acc, 1)
    acc.end_training()  # a clean end: not a failure in the record
    runs = json.loads((tmp_path / "auto" / "checkpoints" / RUNS_NAME).read_text())["runs"]
    assert len(runs) == 1 and runs[0]["end"] is not None


def test_without_a_cadence_it_says_what_to_set(tmp_path, closing) -> None:
    acc = make_accelerator(tmp_path)
    with pytest.raises(ConfigError, match="enable"):
        fastckpt_accelerate.should_checkpoint(acc, 1)
    closing.append(fastckpt_accelerate.enable(acc))
    with pytest.raises(ConfigError, match="cadence.interval"):
        fastckpt_accelerate.should_checkpoint(acc, 1)
