"""What the plugin does to the user's Trainer: nothing they can see (issue 23, items 3 and 13).

Item 3: the plugin's callback runs first in every hook, from ``setup`` on, without being in ``trainer.callbacks``:
the user's list is stock's, and a callback that saves runs once per hook.
Item 13: the plugin's ``fastckpt/*`` figures reach the user's loggers only with ``log_stats=True``, and then only in
the rows the user's ``log_every_n_steps`` writes anyway.
"""

from __future__ import annotations

import csv
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from fastckpt_lightning import FastCheckpointCallback, FastCheckpointIO
from helpers import assert_bit_equal
from lightning_support import FlushEachBatch, ResumableBatches, TinyModule, make_trainer, training_state

pytestmark = pytest.mark.timeout(120)


class SaveAndCount(Callback):
    """A user callback that saves at some steps from ``on_train_batch_end`` and counts its calls."""

    def __init__(self, dirpath: Any, steps: tuple[int, ...], log: list[str]) -> None:
        self.dirpath, self.steps, self.calls = dirpath, steps, log
        self.batch_ends = 0
        self.saved: dict[str, dict[str, Any]] = {}

    def setup(self, trainer, pl_module, stage) -> None:
        self.calls.append("user.setup")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.calls.append("user.on_train_batch_end")
        self.batch_ends += 1
        if trainer.global_step in self.steps:
            path = str(self.dirpath / f"user-{trainer.global_step}-{self.batch_ends}.ckpt")
            self.saved[path] = training_state(pl_module)
            trainer.save_checkpoint(path)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.calls.append("user.on_before_optimizer_step")


def _spy(monkeypatch, log: list[str]) -> None:
    """Record when the plugin's callback runs, keeping what it does."""
    for hook in ("setup", "on_train_batch_end", "on_before_optimizer_step"):
        real = getattr(FastCheckpointCallback, hook)

        def spied(self, *args, _real=real, _hook=hook, **kwargs):
            log.append(f"fastckpt.{_hook}")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(FastCheckpointCallback, hook, spied)


def _run(tmp_path, plugin: FastCheckpointIO | None, log: list[str], **trainer_options):
    user = SaveAndCount(tmp_path / "user", steps=(2, 4), log=log)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=3, save_top_k=-1)
    callbacks = [user, checkpoints, *trainer_options.pop("extra", [])]
    trainer = make_trainer(callbacks, plugin, max_steps=6, **trainer_options)
    trainer.fit(TinyModule(), ResumableBatches())
    return trainer, user


def test_callbacks_run_once_and_the_list_is_the_users(tmp_path, monkeypatch):
    stock_trainer, stock_user = _run(tmp_path / "stock", None, [])
    log: list[str] = []
    _spy(monkeypatch, log)
    plugin = FastCheckpointIO(persist={"fsync": False})
    trainer, user = _run(tmp_path / "fast", plugin, log)

    # The list is stock's, element for element: the plugin's callback is not in it.
    assert [type(c) for c in trainer.callbacks] == [type(c) for c in stock_trainer.callbacks]
    assert trainer.callbacks[0] is user and all(c is not plugin.callback for c in trainer.callbacks)
    # The saving callback ran once per batch (not again after the first save), and saved once per chosen step.
    assert user.batch_ends == stock_user.batch_ends == 6
    assert len(user.saved) == len(stock_user.saved) == 2
    # The plugin's hooks ran, first in each hook, from setup on (before any save).
    assert log[:2] == ["fastckpt.setup", "user.setup"]
    for hook in ("on_train_batch_end", "on_before_optimizer_step"):
        calls = [entry for entry in log if entry.endswith(hook)]
        assert calls == [f"fastckpt.{hook}", f"user.{hook}"] * 6, calls
    # What was saved is what the weights were at the save, bit for bit.
    for path, expected in user.saved.items():
        saved = torch.load(path, weights_only=True)
        assert_bit_equal({k: saved[k] for k in expected}, expected)


def test_a_callback_passed_explicitly_runs_once_where_the_user_put_it(tmp_path, monkeypatch):
    log: list[str] = []
    _spy(monkeypatch, log)
    plugin = FastCheckpointIO(persist={"fsync": False})
    trainer, user = _run(tmp_path, plugin, log, extra=[plugin.callback])
    assert sum(c is plugin.callback for c in trainer.callbacks) == 1
    calls = [entry for entry in log if entry.endswith("on_before_optimizer_step")]
    assert calls == ["user.on_before_optimizer_step", "fastckpt.on_before_optimizer_step"] * 6, calls
    assert user.batch_ends == 6 and len(user.saved) == 2


def test_a_trainer_without_the_plugin_is_untouched(tmp_path, monkeypatch):
    log: list[str] = []
    _spy(monkeypatch, log)
    FastCheckpointIO()  # installs the dispatch; this Trainer does not use it
    _run(tmp_path, None, log)
    assert not [entry for entry in log if entry.startswith("fastckpt.")]


# ---- item 13: the user's logs -------------------------------------------------------------------------------------


def _metrics(logger: CSVLogger) -> tuple[list[str], list[dict[str, str]]]:
    with open(logger.experiment.metrics_file_path) as stream:
        reader = csv.DictReader(stream)
        return list(reader.fieldnames or []), list(reader)


def _logged_run(tmp_path, plugin: FastCheckpointIO | None):
    logger = CSVLogger(tmp_path / "csv")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=2, save_top_k=-1)
    flush = [FlushEachBatch()] if plugin is not None else []  # figures there by the batch's end, whatever the load
    trainer = make_trainer([*flush, checkpoints], plugin, max_steps=12, logger=logger, log_every_n_steps=4)
    trainer.fit(TinyModule(), ResumableBatches())
    return _metrics(logger)


def test_stats_stay_out_of_the_users_loggers_by_default(tmp_path):
    stock_header, stock_rows = _logged_run(tmp_path / "stock", None)
    plugin = FastCheckpointIO(persist={"fsync": False})
    header, rows = _logged_run(tmp_path / "fast", plugin)
    assert header == stock_header and not [h for h in header if h.startswith("fastckpt/")]
    assert [r["step"] for r in rows] == [r["step"] for r in stock_rows]
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in stock_rows]  # the same training
    assert [s.step for s in plugin.stats] == [2, 4, 6, 8, 10, 12]  # kept for Python either way


def test_log_stats_joins_the_users_rows_at_the_users_cadence(tmp_path):
    stock_header, stock_rows = _logged_run(tmp_path / "stock", None)
    plugin = FastCheckpointIO(persist={"fsync": False}, log_stats=True)
    header, rows = _logged_run(tmp_path / "fast", plugin)
    ours = [h for h in header if h.startswith("fastckpt/")]
    assert sorted(ours) == sorted(f"fastckpt/{f}" for f in ("blocking_ms", "waited_ms", "stall_ms", "staging_ms",
                                                            "persist_s", "nbytes", "throughput_mb_s",
                                                            "written_bytes"))
    assert sorted(set(header) - set(ours)) == sorted(stock_header)
    # The same rows at the same steps, in order: no row and no step of the plugin's own.
    assert [r["step"] for r in rows] == [r["step"] for r in stock_rows]
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in stock_rows]
    figures = {s.nbytes for s in plugin.stats}
    carried = [r for r in rows if r["fastckpt/nbytes"]]
    assert carried, rows  # the checkpoints committed during the run show up in the user's rows
    for row in carried:  # each row carries the figures of a checkpoint committed by then
        assert float(row["fastckpt/nbytes"]) in figures
        # self.log keeps metrics as float32 tensors
        steps = [s.step for s in plugin.stats if _f32(s.blocking_ms) == float(row["fastckpt/blocking_ms"])]
        assert steps and steps[0] <= int(row["step"]) + 1, (row, plugin.stats)


def _f32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def test_the_plugin_pickles_with_its_logging_choice(tmp_path):
    import pickle

    plugin = pickle.loads(pickle.dumps(FastCheckpointIO(log_stats=True)))
    trainer = make_trainer([], plugin, max_steps=2, logger=CSVLogger(tmp_path / "csv"), log_every_n_steps=1)
    trainer.fit(TinyModule(), ResumableBatches())
    assert plugin.callback not in trainer.callbacks
