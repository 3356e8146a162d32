"""Loggers that log checkpoints (MLflow, Weights & Biases offline) see the files stock Lightning gives them (issue 23,
item 1), and a save the user's own code asks for is complete when the call returns (item 2).

Every fastckpt run here writes through a storage whose file writes wait until training has moved on (the next
batch, validation, or the end of training): a logger that scans the folder right after a save, as
``MLFlowLogger``/``WandbLogger(log_model="all")`` do, would find the new file missing, or ``last.ckpt`` stale.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from fastckpt import Checkpointer, CheckpointConfig, LocalStorage
from fastckpt_lightning import FastCheckpointIO
from fastckpt_lightning.discovery import scheduled_by_lightning
from lightning_support import make_trainer
from lightning_models import TinyModule

pytestmark = pytest.mark.timeout(240)

STEPS_PER_EPOCH = 8
WAIT_S = 60  # a writer held longer than this means training is stuck behind it: fail, don't hang


class LandLater:
    """Local storage whose file writes wait until training has moved past the save that made them."""

    def __init__(self, root: str, plugin: "LateIO") -> None:
        self._inner = LocalStorage(root, direct_io="off", fsync=False)
        self.url = self._inner.url
        self.plugin = plugin

    def write_file_atomic(self, path: str, parts: Any) -> None:
        self.plugin.wait_until_past(path)
        self._inner.write_file_atomic(path, parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class LateIO(FastCheckpointIO):
    """The plugin over ``LandLater`` storage: a ModelCheckpoint save's file lands once training reached the next
    batch start, validation or the end of training (``advance``); the training thread blocking on a save of its
    own (a user's save), or on every pending save (``flush``), lets every earlier one land, as time passing would."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("persist", {"fsync": False})
        super().__init__(**kwargs)
        self.progress = 0
        self.moved = threading.Condition()
        self.release_at: dict[str, list[int]] = {}  # per path, one entry per save, in order (files land in order)

    def advance(self) -> None:
        with self.moved:
            self.progress += 1
            self.moved.notify_all()

    def wait_until_past(self, path: str) -> None:
        with self.moved:
            queue = self.release_at.get(path) or [0]
            release = queue.pop(0)
            if not self.moved.wait_for(lambda: self.progress >= release, WAIT_S):
                raise TimeoutError(f"training never moved past the save of {path}")

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        if self.relay.needs(os.fspath(path)):
            self.advance()  # the plugin waits for earlier saves to land first: time passes for them
        if scheduled_by_lightning():
            with self.moved:
                self.release_at.setdefault(os.fspath(path), []).append(self.progress + 1)
        else:
            self.advance()
            with self.moved:
                self.release_at.setdefault(os.fspath(path), []).append(0)
        super().save_checkpoint(checkpoint, path, storage_options)

    def flush(self) -> None:
        self.advance()  # the training thread waits for every pending save (user code at a boundary): time passes
        super().flush()

    def _create_checkpointer(self, config: CheckpointConfig) -> Checkpointer:
        return Checkpointer(config, storage=LandLater(config.root, self))


class MoveOn(Callback):
    """Training moved on: the files of earlier ModelCheckpoint saves may land."""

    def __init__(self, plugin: LateIO) -> None:
        self.plugin = plugin

    def on_train_batch_start(self, *args: Any) -> None:
        self.plugin.advance()

    on_validation_start = on_train_batch_start
    on_train_end = on_train_batch_start


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8 * STEPS_PER_EPOCH, 16, generator=generator),
                         torch.randn(8 * STEPS_PER_EPOCH, 1, generator=generator))
    return DataLoader(data, batch_size=8)


def _fit(dirpath: Path, logger: Any, fast: bool, extra: list[Callback] = ()) -> LateIO | None:
    """Three epochs with a ModelCheckpoint that keeps the best 2 by loss, saves last.ckpt, every 3 steps."""
    plugin = LateIO() if fast else None
    checkpoint = ModelCheckpoint(dirpath=str(dirpath), monitor="train_loss", save_top_k=2, save_last=True,
                                 every_n_train_steps=3, filename="{epoch}-{step}")
    callbacks: list[Callback] = [checkpoint, *extra]
    if plugin is not None:
        callbacks.append(MoveOn(plugin))
    torch.manual_seed(0)
    trainer = make_trainer(callbacks, plugin, max_epochs=3, logger=logger, log_every_n_steps=1)
    trainer.fit(TinyModule(), _loader())
    return plugin


def _same_checkpoint(stock: str, fast: str) -> None:
    """What a user restores from a logged checkpoint, bit for bit."""
    a, b = torch.load(stock, weights_only=False), torch.load(fast, weights_only=False)
    assert (a["epoch"], a["global_step"]) == (b["epoch"], b["global_step"]), (stock, fast)
    for key, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][key]), f"{fast}: state_dict[{key}] differs"
    for sa, sb in zip(a["optimizer_states"], b["optimizer_states"]):
        for index, state in sa["state"].items():
            for name, value in state.items():
                assert torch.equal(value, sb["state"][index][name]), f"{fast}: optimizer state {index}.{name}"
    assert a["lr_schedulers"] == b["lr_schedulers"]


def _mlflow_artifacts(tracking: Path) -> dict[str, Path]:
    runs = [p for p in tracking.rglob("artifacts") if p.is_dir()]
    assert len(runs) == 1, runs
    return {str(p.relative_to(runs[0])): p for p in runs[0].rglob("*") if p.is_file()}


def test_mlflow_log_model_all_logs_the_files_stock_logs(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="mlflow-skinny is not installed (the [test] extra has it)")
    from lightning.pytorch.loggers import MLFlowLogger

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow's own switch: a file store needs no database

    for kind in ("stock", "fast"):
        logger = MLFlowLogger(experiment_name="e", tracking_uri=f"file:{tmp_path / kind / 'mlruns'}",
                              log_model="all")
        _fit(tmp_path / kind / "ckpts", logger, fast=kind == "fast")
    stock, fast = _mlflow_artifacts(tmp_path / "stock" / "mlruns"), _mlflow_artifacts(tmp_path / "fast" / "mlruns")
    assert sorted(fast) == sorted(stock)  # every checkpoint logged, the final ones and last.ckpt included
    assert any(name.startswith("last/") for name in stock) and len([n for n in stock if n.endswith(".ckpt")]) > 3
    for name, path in stock.items():
        if name.endswith(".ckpt"):
            _same_checkpoint(str(path), str(fast[name]))
        else:  # metadata.yaml (score, file name, settings) and aliases.txt (which one is "best")
            assert filecmp.cmp(path, fast[name], shallow=False), name


class WandbSpy:
    """What ``run.log_artifact`` received: metadata, aliases, and the bytes of the file at that moment (the real
    client logs it too; offline, its staging copy is not a stable place to read it back)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.logged: list[tuple[dict, list[str], Path]] = []

    def install(self, logger: Any) -> None:
        run = logger.experiment
        real = run.log_artifact

        def log_artifact(artifact: Any, *args: Any, aliases: Any = None, **kwargs: Any) -> Any:
            entry = artifact.manifest.entries["model.ckpt"]
            copy = self.out / f"{len(self.logged)}.ckpt"
            shutil.copyfile(entry.local_path, copy)
            self.logged.append((dict(artifact.metadata), list(aliases or []), copy))
            return real(artifact, *args, aliases=aliases, **kwargs)

        run.log_artifact = log_artifact


def test_wandb_offline_log_model_all_logs_the_files_stock_logs(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (the [test] extra has it)")
    from lightning.pytorch.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")  # offline=True refuses log_model; the client itself runs offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    spies = {}
    for kind in ("stock", "fast"):
        (tmp_path / kind).mkdir()
        logger = WandbLogger(project="p", save_dir=str(tmp_path / kind), log_model="all")
        spies[kind] = WandbSpy(tmp_path / kind)
        spies[kind].install(logger)
        _fit(tmp_path / kind / "ckpts", logger, fast=kind == "fast")
        logger.experiment.finish()
    stock, fast = spies["stock"].logged, spies["fast"].logged
    assert len(stock) > 3
    order = lambda logged: [(m["original_filename"], m["score"], a) for m, a, _ in logged]  # noqa: E731
    assert order(fast) == order(stock)  # same files, same scores, same aliases ("best" on the same file), in order
    for (ms, _, ps), (mf, _, pf) in zip(stock, fast):
        assert ms == mf
        _same_checkpoint(str(ps), str(pf))


class SaveAndUse(Callback):
    """The user's pattern: save, then copy and load the file right away (same name every epoch: stale if late)."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = dirpath
        self.loaded: list[tuple[int, dict]] = []

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        path = self.dirpath / "mine.ckpt"
        trainer.save_checkpoint(path)
        shutil.copyfile(path, self.dirpath / f"copy-{trainer.current_epoch}.ckpt")
        loaded = torch.load(path, weights_only=False)
        expected = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.loaded.append((loaded["global_step"], expected))
        assert loaded["global_step"] == trainer.global_step, "the file of an earlier save"
        for key, tensor in expected.items():
            assert torch.equal(loaded["state_dict"][key], tensor), key


def test_a_save_the_users_callback_asks_for_is_complete_when_it_returns(tmp_path):
    user = SaveAndUse(tmp_path / "user")
    (tmp_path / "user").mkdir()
    plugin = _fit(tmp_path / "ckpts", False, fast=True, extra=[user])
    assert [step for step, _ in user.loaded] == [STEPS_PER_EPOCH * (e + 1) for e in range(3)]
    assert plugin is not None and plugin.stats  # the ModelCheckpoint saves stayed asynchronous (through the plugin)


def test_async_user_saves_opt_in_keeps_a_users_save_asynchronous(tmp_path):
    """With ``async_user_saves=True`` the user's save returns before the file lands (then ``fit`` ends complete)."""
    seen: list[bool] = []

    class Save(Callback):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            trainer.save_checkpoint(tmp_path / "user" / f"e{trainer.current_epoch}.ckpt")
            seen.append((tmp_path / "user" / f"e{trainer.current_epoch}.ckpt").exists())

    plugin = LateIO(async_user_saves=True)
    torch.manual_seed(0)
    trainer = make_trainer([Save(), MoveOn(plugin)], plugin, max_epochs=2, enable_checkpointing=False)
    trainer.fit(TinyModule(), _loader())
    assert seen == [False, False]
    assert sorted(os.listdir(tmp_path / "user")) == ["e0.ckpt", "e1.ckpt"]


# ---- issue 54, item 13: loggers that are not Logger subclasses ------------------------------------------------


class EveryStage(TinyModule):
    """TinyModule with the steps ``validate``, ``test`` and ``predict`` need."""

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss)
        return loss

    test_step = validation_step

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])


class DuckLogger:
    """A logger by duck typing (not a ``Logger`` subclass) with no ``after_save_checkpoint``: what Lightning itself
    calls on a logger during these runs, and nothing more."""

    save_dir = None
    log_dir = None
    name = "duck"
    version = 0
    group_separator = "/"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def log_metrics(self, metrics: Any, step: Any = None) -> None:
        self.calls.append("log_metrics")

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.append("log_hyperparams")

    def log_graph(self, model: Any, input_array: Any = None) -> None:
        self.calls.append("log_graph")

    def save(self) -> None:
        self.calls.append("save")

    def finalize(self, status: str) -> None:
        self.calls.append("finalize")


def _mock_logger(kind: str) -> Any:
    from unittest import mock

    from lightning.pytorch.loggers import Logger

    if kind == "duck":
        return DuckLogger()
    logger = {"Mock": mock.Mock, "MagicMock": mock.MagicMock, "spec": lambda: mock.Mock(spec=Logger)}[kind]()
    logger.save_dir, logger.log_dir, logger.name, logger.version = None, None, "mock", 0
    return logger


def _calls(logger: Any) -> list[str]:
    """The logger methods Lightning called, in order (a mock's recorded calls, or the duck's own list)."""
    if type(logger) is DuckLogger:  # not isinstance: Mock(spec=DuckLogger) claims to be one
        return list(logger.calls)
    return [call[0] for call in logger.mock_calls]


def _run_stage(stage: str, logger: Any, plugin: Any, root: Path, checkpointing: bool = False) -> Any:
    torch.manual_seed(0)
    callbacks: list[Callback] = []
    if checkpointing:
        callbacks.append(ModelCheckpoint(dirpath=str(root), every_n_train_steps=2, save_top_k=-1))
    trainer = make_trainer(callbacks, plugin, max_steps=4, logger=logger, log_every_n_steps=1,
                           enable_checkpointing=checkpointing, limit_val_batches=2)
    module = EveryStage()
    loader = _loader()
    run = {"fit": lambda: trainer.fit(module, loader), "validate": lambda: trainer.validate(module, loader),
           "test": lambda: trainer.test(module, loader), "predict": lambda: trainer.predict(module, loader)}
    return run[stage]()


@pytest.mark.parametrize("kind", ["Mock", "MagicMock", "spec", "duck"])
def test_a_logger_fastckpt_cannot_wrap_is_left_as_stock_leaves_it(tmp_path, kind):
    """Every stage runs with a Mock, MagicMock, ``Mock(spec=...)`` or duck-typed logger, checkpointing off, and the
    logger sees the calls it sees without the plugin, in the same order; nothing is set on it. Before the fix the
    plugin's setup raised ``AttributeError`` (it read ``type(logger).after_save_checkpoint``) for all but MagicMock
    (Lightning turns a MagicMock into no logger at all: it is iterable)."""
    for stage in ("fit", "validate", "test", "predict"):
        stock, fast = _mock_logger(kind), _mock_logger(kind)
        _run_stage(stage, stock, None, tmp_path / "stock")
        _run_stage(stage, fast, FastCheckpointIO(root=str(tmp_path / "fast")), tmp_path / "fast")
        assert _calls(fast) == _calls(stock), stage
        assert "after_save_checkpoint" not in vars(fast), stage


@pytest.mark.parametrize("kind", ["Mock", "spec"])
def test_a_mock_logger_sees_every_save_as_with_stock(tmp_path, kind):
    """With checkpointing on, a Mock logger's ``after_save_checkpoint`` is the Mock's own, called once per save, as
    stock calls it, and the saved files are the ones stock saves."""
    counts = {}
    for name, plugin in (("stock", None), ("fast", FastCheckpointIO(persist={"fsync": False}))):
        logger = _mock_logger(kind)
        _run_stage("fit", logger, plugin, tmp_path / name, checkpointing=True)
        counts[name] = logger.after_save_checkpoint.call_count
    assert counts["fast"] == counts["stock"] == 2
    assert sorted(os.listdir(tmp_path / "fast")) == sorted(os.listdir(tmp_path / "stock"))
    for file in os.listdir(tmp_path / "stock"):
        _same_checkpoint(str(tmp_path / "stock" / file), str(tmp_path / "fast" / file))


class DuckCheckpointLogger(DuckLogger):
    """A duck-typed logger that logs checkpoints: its ``after_save_checkpoint`` reads the newest file, as
    ``MLFlowLogger(log_model="all")`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, bool]] = []

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        path = checkpoint_callback.last_model_path or checkpoint_callback.best_model_path
        self.seen.append((os.path.basename(path), os.path.isfile(path)))


def test_a_duck_typed_logger_with_the_method_is_wrapped_and_sees_complete_files(tmp_path):
    """"Wrap what is there": a duck-typed logger that defines ``after_save_checkpoint`` gets the same deferral as a
    ``Logger`` subclass (files land late here: unwrapped, it would find none of them)."""
    logger = DuckCheckpointLogger()
    _fit(tmp_path / "ckpts", logger, fast=True)
    assert logger.seen and all(present for _, present in logger.seen), logger.seen
