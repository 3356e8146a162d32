"""Health of every checkpoint in Lightning (issue 25, item 2): a run that turns NaN at step N resumes from the file
before N through ``ckpt_path="last-healthy"`` or ``find_healthy_checkpoint``; stock ``torch.load`` unaffected."""
from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from fastckpt_lightning import FastCheckpointIO, find_healthy_checkpoint
from helpers import assert_bit_equal
from lightning_support import ResumableBatches, TinyModule, ckpt_names, make_trainer, training_state

NAN_AT = 3


class PoisonAt(Callback):
    """A weight turns NaN after the optimizer step of ``NAN_AT`` (before ModelCheckpoint saves that step)."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
        if trainer.global_step >= NAN_AT:
            with torch.no_grad():
                pl_module.net[0].weight[0, 0] = float("nan")
        self.by_step[trainer.global_step] = training_state(pl_module)


class SeeStart(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.step, self.state = trainer.global_step, training_state(pl_module)


def _fit(dirpath: str, callbacks: list[Callback], max_steps: int, ckpt_path: Any = None) -> None:
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer([*callbacks, checkpoint], FastCheckpointIO(), max_steps=max_steps)
    trainer.fit(TinyModule(), train_dataloaders=ResumableBatches(), ckpt_path=ckpt_path)


def test_nan_at_step_n_resumes_from_the_file_before(tmp_path) -> None:
    dirpath = str(tmp_path / "ckpt")
    poison = PoisonAt()
    _fit(dirpath, [poison], max_steps=5)
    names = ckpt_names(dirpath)
    assert len(names) == 5 and all(os.path.exists(os.path.join(dirpath, f".{n}.fastckpt-health.json")) for n in names)
    best = find_healthy_checkpoint(dirpath)
    assert best == os.path.join(dirpath, f"epoch=0-step={NAN_AT - 1}.ckpt")
    plain = torch.load(best, weights_only=False)  # stock loading: the sidecar changes nothing
    assert plain["global_step"] == NAN_AT - 1
    assert_bit_equal({k: plain[k] for k in ("state_dict", "optimizer_states")}, poison.by_step[NAN_AT - 1])

    resumed = SeeStart()
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer([resumed, checkpoint], FastCheckpointIO(), max_steps=NAN_AT + 1)
    trainer.fit(TinyModule(), train_dataloaders=ResumableBatches(), ckpt_path="last-healthy")
    assert resumed.step == NAN_AT - 1
    assert_bit_equal(resumed.state, poison.by_step[NAN_AT - 1])


def test_no_healthy_file_is_none(tmp_path) -> None:
    dirpath = tmp_path / "ckpt"
    dirpath.mkdir()
    torch.save({"w": torch.ones(2)}, dirpath / "stock.ckpt")  # stock Lightning's file: no health record
    assert find_healthy_checkpoint(str(dirpath)) is None
