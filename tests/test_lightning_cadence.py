"""``FastModelCheckpoint(every="auto")``: Lightning saves at the cadence the core chose from measured costs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from fastckpt import ConfigError
from fastckpt_lightning import FastCheckpointIO
from fastckpt_lightning.model_checkpoint import FastModelCheckpoint
from helpers import assert_bit_equal
from lightning_support import RecordAfterStep, ResumableBatches, TinyModule, make_trainer


class Recording(FastModelCheckpoint):
    """Records each save's step and the interval (steps) the cadence chose there for the next one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.saves: list[tuple[int, int | None]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        before = self._last_global_step_saved
        super().on_train_batch_end(trainer, *args)
        if self._last_global_step_saved != before:
            self.saves.append((trainer.global_step, self.cadence_stats.interval_steps))


def _fit(tmp_path: Path, checkpoint: Recording, plugin: FastCheckpointIO, steps: int = 40) -> RecordAfterStep:
    record = RecordAfterStep()
    trainer = make_trainer([record, checkpoint], plugin, max_steps=steps, limit_val_batches=0)
    trainer.fit(TinyModule(), ResumableBatches())
    return record


def test_auto_saves_at_the_chosen_cadence(tmp_path) -> None:
    plugin = FastCheckpointIO(persist={"fsync": False})
    checkpoint = Recording(dirpath=str(tmp_path), save_top_k=-1, every="auto", every_n_train_steps=25,
                           cadence={"mtbf_s": 0.02, "min_interval_s": 0.0})
    record = _fit(tmp_path, checkpoint, plugin)
    st = checkpoint.cadence_stats
    assert st.mode == "auto" and st.saves_measured >= 2 and st.cost_s > 0  # the plugin's measured stalls
    saves = checkpoint.saves
    assert len(saves) >= 4
    # each gap is the interval the cadence chose at the save before it (from the second plan on: the first had
    # no measured cost yet)
    assert [b[0] - a[0] for a, b in zip(saves[1:], saves[2:])] == [p for _, p in saves[1:-1]]
    assert st.baseline_loss_s == pytest.approx(25 * st.step_s / 2)  # stock's every_n_train_steps=25, beside
    files = {int(p.stem.split("step=")[1]) for p in tmp_path.glob("*.ckpt")}
    assert files == {s for s, _ in saves}
    last = saves[-1][0]
    loaded = torch.load(next(tmp_path.glob(f"*step={last}.ckpt")), weights_only=True)
    assert_bit_equal(loaded["state_dict"], record.by_step[last]["state_dict"])


def test_cadence_from_the_plugins_yaml(tmp_path) -> None:
    yaml = tmp_path / "fastckpt.yaml"
    yaml.write_text("persist:\n  fsync: false\ncadence:\n  interval: 7\n")
    checkpoint = Recording(dirpath=str(tmp_path / "ck"), save_top_k=-1)
    _fit(tmp_path, checkpoint, FastCheckpointIO(str(yaml)), steps=22)
    assert [s for s, _ in checkpoint.saves] == [7, 14, 21]


def test_bad_cadence_fields_are_named() -> None:
    with pytest.raises(ConfigError, match="cadence.interval"):
        FastModelCheckpoint(every="sometimes")
    with pytest.raises(ConfigError, match="CadenceOptions"):
        FastModelCheckpoint(every="auto", cadence={"mtbf": 3})
