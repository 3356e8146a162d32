"""Resuming with FastCheckpointIO is bit-exact, locally and on S3, from an explicit path and from "last"."""

from __future__ import annotations

import fsspec
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from fastckpt_lightning import FastCheckpointIO, FastModelCheckpoint, find_last_checkpoint
from helpers import assert_bit_equal
from lightning_support import ResumableBatches, TinyModule, make_trainer, training_state

TOTAL_STEPS = 10
STOP_AT = 5  # mid-epoch: 4 batches per epoch


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """The reference: TOTAL_STEPS without a pause (and without checkpoints)."""
    module = TinyModule(batchnorm=True)
    make_trainer([], None, max_steps=TOTAL_STEPS, enable_checkpointing=False).fit(module, ResumableBatches())
    return training_state(module)


def _train_stop_resume(dirpath: str, ckpt_path: str, storage_options=None, checkpoint_cls=ModelCheckpoint) -> dict:
    def run(max_steps: int, resume_from=None) -> TinyModule:
        plugin = FastCheckpointIO(storage_options=storage_options, persist={"fsync": False})
        checkpoints = checkpoint_cls(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1, save_last=True)
        module = TinyModule(batchnorm=True)
        trainer = make_trainer([checkpoints, start], plugin, max_steps=max_steps)
        trainer.fit(module, ResumableBatches(), ckpt_path=resume_from)
        return module

    start = StartStep()
    run(STOP_AT)
    resumed = run(TOTAL_STEPS, ckpt_path)
    # Training from scratch would end in the same state: prove the second run really started at STOP_AT.
    assert start.steps == [0, STOP_AT]
    assert resumed.trainer.global_step == TOTAL_STEPS
    return training_state(resumed)


class StartStep(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.steps.append(trainer.global_step)


def test_resume_is_bit_exact(tmp_path, uninterrupted):
    state = _train_stop_resume(str(tmp_path), str(tmp_path / f"epoch=1-step={STOP_AT}.ckpt"))
    assert_bit_equal(state, uninterrupted)


def test_resume_from_last_is_bit_exact(tmp_path, uninterrupted):
    assert_bit_equal(_train_stop_resume(str(tmp_path), "last"), uninterrupted)


@pytest.fixture
def s3_defaults(s3_root, monkeypatch):
    """ModelCheckpoint opens its folder with fsspec defaults (no storage options), as it would with AWS env vars."""
    monkeypatch.setitem(fsspec.config.conf, "s3", s3_root.storage_options)
    return s3_root


def test_resume_from_s3_is_bit_exact(s3_defaults, uninterrupted):
    root = s3_defaults.url + "/checkpoints"
    state = _train_stop_resume(root, f"{root}/epoch=1-step={STOP_AT}.ckpt", s3_defaults.storage_options)
    assert_bit_equal(state, uninterrupted)

    fs, _ = fsspec.core.url_to_fs(root)
    path = f"{root}/last.ckpt"
    assert fs.exists(path) and fs.isfile(path) and fs.modified(path)
    assert any(entry.endswith("/last.ckpt") for entry in fs.ls(root, detail=False))


def test_resume_from_last_on_s3(s3_defaults, uninterrupted):
    """Plain ModelCheckpoint loses the s3:// protocol and trains from scratch; FastModelCheckpoint resumes."""
    root = s3_defaults.url + "/checkpoints"
    state = _train_stop_resume(root, "last", s3_defaults.storage_options, checkpoint_cls=FastModelCheckpoint)
    assert_bit_equal(state, uninterrupted)
    assert find_last_checkpoint(root, s3_defaults.storage_options) == f"{root}/last.ckpt"


def test_stock_model_checkpoint_on_s3_cannot_resume_from_last(s3_defaults):
    """What stock ModelCheckpoint does with ckpt_path="last" in an s3:// dirpath (docs/lightning.md, "Resume"):
    Lightning lists the folder, loses the protocol, finds no file, warns and trains from scratch. The checkpoints
    are there (an explicit path or FastModelCheckpoint resumes, tests above)."""
    root = s3_defaults.url + "/checkpoints"
    options = s3_defaults.storage_options

    def run(max_steps: int, resume_from=None) -> list[int]:
        start = StartStep()
        plugin = FastCheckpointIO(storage_options=options, persist={"fsync": False})
        checkpoints = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, save_last=True)
        trainer = make_trainer([checkpoints, start], plugin, max_steps=max_steps)
        trainer.fit(TinyModule(batchnorm=True), ResumableBatches(), ckpt_path=resume_from)
        return start.steps

    run(STOP_AT)
    assert find_last_checkpoint(root, options) == f"{root}/last.ckpt"
    with pytest.warns(UserWarning, match="no last checkpoint available"):
        assert run(STOP_AT + 1, "last") == [0]
