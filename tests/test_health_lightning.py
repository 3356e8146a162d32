"""Health of every checkpoint in Lightning (issue 25, item 2): a run that turns NaN at step N resumes from the file
before N through ``ckpt_path="last-healthy"`` or ``find_healthy_checkpoint``; stock ``torch.load`` unaffected."""
from __future__ import annotations

import errno
import json
import logging
import os
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from fastckpt.cli import main as cli_main
from fastckpt.errors import CheckpointNotFoundError
from fastckpt.format.health import HEALTH_ATTR
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


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fit(dirpath: str, callbacks: list[Callback], max_steps: int, ckpt_path: Any = None) -> None:
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer([*callbacks, checkpoint], FastCheckpointIO(), max_steps=max_steps)
    trainer.fit(TinyModule(), train_dataloaders=ResumableBatches(), ckpt_path=ckpt_path)


def test_nan_at_step_n_resumes_from_the_file_before(tmp_path) -> None:
    dirpath = str(tmp_path / "ckpt")
    poison = PoisonAt()
    _fit(dirpath, [poison], max_steps=5)
    names = ckpt_names(dirpath)
    assert len(names) == 5 and all(os.getxattr(os.path.join(dirpath, n), HEALTH_ATTR) for n in names)
    best = find_healthy_checkpoint(dirpath)
    assert best == os.path.join(dirpath, f"epoch=0-step={NAN_AT - 1}.ckpt")
    plain = torch.load(best, weights_only=False)  # stock loading: the extended attribute changes nothing
    assert plain["global_step"] == NAN_AT - 1
    assert_bit_equal({k: plain[k] for k in ("state_dict", "optimizer_states")}, poison.by_step[NAN_AT - 1])

    resumed = SeeStart()
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer([resumed, checkpoint], FastCheckpointIO(), max_steps=NAN_AT + 1)
    said = _Lines()
    lightning_log = logging.getLogger("lightning.pytorch")  # Lightning's own messages: shown by its handler
    lightning_log.addHandler(said)
    try:
        trainer.fit(TinyModule(), train_dataloaders=ResumableBatches(), ckpt_path="last-healthy")
    finally:
        lightning_log.removeHandler(said)
    assert resumed.step == NAN_AT - 1
    # issue 55, item 9: Lightning says "Restoring ... at last-healthy"; the plugin names the file it chose
    assert f'fastckpt: ckpt_path="last-healthy" is {best} (step {NAN_AT - 1})' in "\n".join(said.lines), said.lines
    assert_bit_equal(resumed.state, poison.by_step[NAN_AT - 1])


def test_no_healthy_file_is_none(tmp_path) -> None:
    dirpath = tmp_path / "ckpt"
    dirpath.mkdir()
    torch.save({"w": torch.ones(2)}, dirpath / "stock.ckpt")  # stock Lightning's file: no health record
    assert find_healthy_checkpoint(str(dirpath)) is None


def _fit_steps(dirpath: str, plugin: Any) -> None:
    """Every step saved, the best by ``train_loss`` and ``last.ckpt`` kept too: each kind of name stock writes."""
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=2, monitor="train_loss",
                                 save_last=True)
    make_trainer([checkpoint], plugin, max_steps=4).fit(TinyModule(), train_dataloaders=ResumableBatches())


def test_a_fit_with_health_lists_exactly_what_stock_lists(tmp_path) -> None:
    _fit_steps(str(tmp_path / "stock"), None)
    _fit_steps(str(tmp_path / "fast"), FastCheckpointIO(persist={"fsync": False}))
    stock = sorted(os.listdir(tmp_path / "stock"))
    assert sorted(os.listdir(tmp_path / "fast")) == stock and "last.ckpt" in stock  # nothing beside the files
    for name in stock:  # ...yet each carries its health record, and reads as stock's
        record = json.loads(os.getxattr(tmp_path / "fast" / name, HEALTH_ATTR))
        assert record["health"]["healthy"] is True and record["size"] == os.path.getsize(tmp_path / "fast" / name)
        assert torch.load(tmp_path / "fast" / name, weights_only=False).keys() == \
            torch.load(tmp_path / "stock" / name, weights_only=False).keys()
    assert find_healthy_checkpoint(str(tmp_path / "fast")) is not None


def test_a_file_system_refusing_extended_attributes_gives_unknown_health_and_no_file(tmp_path, monkeypatch,
                                                                                        caplog, capsys) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOTSUP, os.strerror(errno.ENOTSUP))

    monkeypatch.setattr(os, "setxattr", refuse)
    import fastckpt.storage.xattr as xattr

    monkeypatch.setattr(xattr, "_told", set())  # this process may have logged it already: log it again here
    dirpath = str(tmp_path / "ckpt")
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        _fit(dirpath, [], max_steps=3)
    assert sorted(os.listdir(dirpath)) == [f"epoch=0-step={s}.ckpt" for s in (1, 2, 3)]  # no sidecar instead
    assert all(os.listxattr(os.path.join(dirpath, n)) == [] for n in os.listdir(dirpath))
    said = [r for r in caplog.records if "keeps no user extended attributes" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO  # once, not once per checkpoint
    assert find_healthy_checkpoint(dirpath) is None  # unknown: never called healthy
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint in .* has a health record"):
        _fit(dirpath, [], max_steps=4, ckpt_path="last-healthy")
    assert cli_main(["list", dirpath, "--json"]) == 0
    assert [r["health"] for r in json.loads(capsys.readouterr().out)] == ["-", "-", "-"]


def test_last_healthy_never_picks_a_nan_file_copied_over_a_healthy_one(tmp_path) -> None:
    # `cp diverged.ckpt epoch=0-step=3.ckpt` rewrites the file in place: its health attribute stays, now describing
    # other bytes (the same size: the same model). The record is tied to the zip's CRC-32s, so it is not believed.
    import io
    import subprocess

    dirpath = str(tmp_path / "ckpt")
    recorder = _Record()
    _fit(dirpath, [recorder], max_steps=3)
    newest = os.path.join(dirpath, "epoch=0-step=3.ckpt")
    diverged = torch.load(newest, weights_only=False)
    for weight in diverged["state_dict"].values():
        weight.fill_(float("nan"))  # in place: the same structure, pickled to the same length
    buf = io.BytesIO()  # through a buffer: its records are named archive/..., as in the plugin's files
    torch.save(diverged, buf)
    (tmp_path / "diverged.ckpt").write_bytes(buf.getvalue())
    assert os.path.getsize(tmp_path / "diverged.ckpt") == os.path.getsize(newest)
    subprocess.run(["cp", str(tmp_path / "diverged.ckpt"), newest], check=True)
    assert json.loads(os.getxattr(newest, HEALTH_ATTR))["health"]["healthy"] is True  # the stale record
    resumed = SeeStart()
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1)
    trainer = make_trainer([resumed, checkpoint], FastCheckpointIO(), max_steps=4)
    trainer.fit(TinyModule(), train_dataloaders=ResumableBatches(), ckpt_path="last-healthy")
    assert resumed.step == 2
    assert_bit_equal(resumed.state, recorder.by_step[2])


class _Record(Callback):
    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, Any]] = {}

    def on_train_batch_end(self, trainer, pl_module, *args: Any) -> None:
        self.by_step[trainer.global_step] = training_state(pl_module)
