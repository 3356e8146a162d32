"""FastCheckpointIO behaves as stock Lightning where Lightning looks without asking the plugin: SLURM requeue
(``ckpt_path="hpc"``), ``save_last`` files and links, a stock process reading our files, a shared YAML config."""

from __future__ import annotations

import os
import pathlib
import signal
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from fastckpt_lightning import FastCheckpointIO
from helpers import assert_bit_equal
from lightning_support import GatedIO, RecordAfterStep, ResumableBatches, TinyModule, make_trainer, training_state

HERE = Path(__file__).resolve().parent
TOTAL_STEPS = 10
STOP_AT = 5


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """The reference: TOTAL_STEPS without a pause (and without checkpoints)."""
    module = TinyModule(batchnorm=True)
    make_trainer([], None, max_steps=TOTAL_STEPS, enable_checkpointing=False).fit(module, ResumableBatches())
    return training_state(module)


class StartStep(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.steps.append(trainer.global_step)


def _weights(checkpoint: dict) -> dict:
    return {key: checkpoint[key] for key in ("state_dict", "optimizer_states")}


# ---- SLURM auto-requeue ------------------------------------------------------------------------------------------


class RequeueAt(Callback):
    """Sends this process SLURM's requeue signal after the given steps (Lightning's handler saves, then requeues);
    stops after the last one, as the requeue would."""

    def __init__(self, steps: tuple[int, ...]) -> None:
        self.steps = steps
        self.sent: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        step = trainer.global_step
        if step in self.steps and step not in self.sent:
            self.sent.append(step)
            signal.raise_signal(signal.SIGUSR1)  # the handler runs on this thread before this call returns
            trainer.should_stop = step == self.steps[-1]


@pytest.fixture
def slurm_job(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A SLURM job as Lightning detects it, whose `scontrol requeue` copies the HPC checkpoints present at that
    moment (the real one kills the job): ``(run folder, copies folder)``."""
    run, copies, bin_dir = tmp_path / "run", tmp_path / "at_requeue", tmp_path / "bin"
    for folder in (run, copies, bin_dir):
        folder.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\ncp "{run}"/hpc_ckpt_*.ckpt "{copies}"/ 2>/dev/null\nexit 0\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for key, value in dict(SLURM_NTASKS="1", SLURM_JOB_NAME="train", SLURM_JOB_ID="77", SLURM_NODEID="0",
                           SLURM_LOCALID="0", SLURM_PROCID="0").items():
        monkeypatch.setenv(key, value)
    return run, copies


def test_slurm_requeue_checkpoint_is_complete_and_resumes_from_hpc(slurm_job, uninterrupted):
    """Lightning saves `hpc_ckpt_N.ckpt` in its SIGUSR1 handler, then requeues the job (which kills it): the file is
    complete by then, numbered after the previous one, and `fit(ckpt_path="hpc")` resumes from the newest."""
    run, copies = slurm_job
    recorder, requeue = RecordAfterStep(), RequeueAt((3, STOP_AT))
    plugin = GatedIO()  # lazy copies held back until the training thread waits: no race can save the test
    trainer = make_trainer([recorder, requeue], plugin, max_steps=TOTAL_STEPS, enable_checkpointing=False,
                           default_root_dir=str(run))
    trainer.fit(TinyModule(batchnorm=True), ResumableBatches())
    assert requeue.sent == [3, STOP_AT]

    assert sorted(os.listdir(copies)) == ["hpc_ckpt_1.ckpt", "hpc_ckpt_2.ckpt"], "not on disk at requeue time"
    for name, step in (("hpc_ckpt_1.ckpt", 3), ("hpc_ckpt_2.ckpt", STOP_AT)):
        at_requeue = torch.load(copies / name, weights_only=True)
        assert at_requeue["global_step"] == step
        assert_bit_equal(_weights(at_requeue), recorder.by_step[step])

    start = StartStep()
    resumed = TinyModule(batchnorm=True)
    plugin = FastCheckpointIO(persist={"fsync": False})
    trainer = make_trainer([start], plugin, max_steps=TOTAL_STEPS, enable_checkpointing=False,
                           default_root_dir=str(run))
    trainer.fit(resumed, ResumableBatches(), ckpt_path="hpc")
    assert start.steps == [STOP_AT]
    assert_bit_equal(training_state(resumed), uninterrupted)


# ---- save_last ---------------------------------------------------------------------------------------------------


def _run_with_save_last(dirpath: Path, save_last, plugin) -> None:
    checkpoints = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=2, monitor="train_loss",
                                  save_last=save_last)
    make_trainer([checkpoints], plugin, max_steps=8).fit(TinyModule(batchnorm=True), ResumableBatches())


def _listing(dirpath: Path) -> dict[str, str | None]:
    """``{name: link target or None}``."""
    return {name: os.readlink(dirpath / name) if os.path.islink(dirpath / name) else None
            for name in sorted(os.listdir(dirpath))}


@pytest.mark.parametrize("save_last", [True, "link"])
def test_save_last_files_and_links_are_stock(tmp_path, save_last, uninterrupted):
    stock, fast = tmp_path / "stock", tmp_path / "fast"
    _run_with_save_last(stock, save_last, None)
    _run_with_save_last(fast, save_last, FastCheckpointIO(persist={"fsync": False}))

    assert _listing(fast) == _listing(stock)
    assert "last.ckpt" in _listing(fast)
    assert (_listing(fast)["last.ckpt"] is not None) is (save_last == "link")
    for name in _listing(fast):
        ours, theirs = torch.load(fast / name, weights_only=True), torch.load(stock / name, weights_only=True)
        assert ours["global_step"] == theirs["global_step"]
        assert_bit_equal(_weights(ours), _weights(theirs), name)

    start = StartStep()
    resumed = TinyModule(batchnorm=True)
    checkpoints = ModelCheckpoint(dirpath=fast, every_n_train_steps=2, save_top_k=2, monitor="train_loss",
                                  save_last=save_last)
    trainer = make_trainer([checkpoints, start], FastCheckpointIO(persist={"fsync": False}), max_steps=TOTAL_STEPS)
    trainer.fit(resumed, ResumableBatches(), ckpt_path="last")
    assert start.steps == [8]
    assert_bit_equal(training_state(resumed), uninterrupted)


class CheckLastLink(Callback):
    """At every batch start: `last.ckpt` is absent or names a complete file, never a file still in flight (GatedIO
    holds the first save's lazy copies back until the next step, so that save is surely in flight then)."""

    def __init__(self, dirpath: Path) -> None:
        self.last = dirpath / "last.ckpt"
        self.seen: list[tuple[int, object]] = []

    def on_train_batch_start(self, trainer, *args) -> None:
        if os.path.lexists(self.last):
            target = os.readlink(self.last)
            assert os.path.exists(self.last), f"step {trainer.global_step}: last.ckpt -> {target}, not on disk yet"
            self.seen.append((trainer.global_step, torch.load(self.last, weights_only=True)["global_step"]))


def test_save_last_link_names_only_landed_files(tmp_path):
    checker = CheckLastLink(tmp_path)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=2, monitor="train_loss",
                                  save_last="link")
    make_trainer([checker, checkpoints], GatedIO(), max_steps=6).fit(TinyModule(), ResumableBatches())

    assert checker.seen and all(saved <= now for now, saved in checker.seen), checker.seen
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 6
    assert os.readlink(tmp_path / "last.ckpt") == "epoch=1-step=6.ckpt"


# ---- a stock process reads our files --------------------------------------------------------------------------


def test_stock_lightning_without_fastckpt_loads_and_resumes(tmp_path, uninterrupted):
    recorder = RecordAfterStep()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    plugin = FastCheckpointIO(persist={"fsync": False})
    make_trainer([recorder, checkpoints], plugin, max_steps=STOP_AT).fit(TinyModule(batchnorm=True),
                                                                         ResumableBatches())
    ckpt = tmp_path / f"epoch=1-step={STOP_AT}.ckpt"
    out = tmp_path / "seen.pt"

    env = dict(os.environ, PYTHONPATH=str(HERE))  # the tests folder only: not the worktree's packages
    done = subprocess.run([sys.executable, str(HERE / "stock_lightning_child.py"), str(ckpt), str(out),
                           str(TOTAL_STEPS)], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]

    seen = torch.load(out, weights_only=True)
    assert seen["fastckpt_modules"] == [] and seen["io"].startswith("lightning.")
    assert seen["hparams"] == {"batchnorm": True, "manual": False, "width": 64}
    assert_bit_equal(seen["loaded"], recorder.by_step[STOP_AT]["state_dict"])
    assert seen["start_step"] == STOP_AT
    assert_bit_equal(seen["resumed"], uninterrupted)


# ---- a YAML shared with the core and the Accelerate hook -------------------------------------------------------


def test_shared_yaml_with_shm_saves_with_one_warning(tmp_path):
    """`staging.shm: true` serves the core's shared-memory tier; Lightning's single files cannot use it, so the
    plugin drops it, saying so once, instead of failing every save."""
    path = tmp_path / "fastckpt.yaml"
    path.write_text(yaml.safe_dump({"root": str(tmp_path / "core"), "staging": {"shm": True},
                                    "persist": {"fsync": False}}))
    recorder = RecordAfterStep()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = FastCheckpointIO(str(path))
        trainer = make_trainer([recorder, checkpoints], plugin, max_steps=3)
        trainer.fit(TinyModule(), ResumableBatches())

    about_shm = [w for w in caught if "staging.shm" in str(w.message)]
    assert len(about_shm) == 1, [str(w.message) for w in caught]
    assert plugin.config.staging.shm is False
    for step in (1, 2, 3):
        saved = torch.load(tmp_path / "ckpt" / f"epoch=0-step={step}.ckpt", weights_only=True)
        assert_bit_equal(_weights(saved), recorder.by_step[step])


# ---- temporary files left by a killed save -----------------------------------------------------------------------


def test_the_first_save_into_a_folder_collects_the_temporary_files_of_dead_saves(tmp_path) -> None:
    """A SIGKILL between a save's first byte and its rename leaves `.NAME.fastckpt-tmp-*` in dirpath (the SIGKILL
    loop in test_lightning_crash.py makes them). The next run's first save there removes those unchanged for
    `orphan_grace_s`, never a recent one (another process may be writing it) nor anything else."""
    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    from fastckpt.storage.tempmark import mark_bytes, mark_name

    dead = dirpath / ".epoch=0-step=4.ckpt.fastckpt-tmp-4242-777"
    recent = dirpath / ".epoch=0-step=6.ckpt.fastckpt-tmp-4243-778"
    unmarked = dirpath / ".epoch=0-step=8.ckpt.fastckpt-tmp-4244-779"  # named like ours, but no marker proves it
    foreign = dirpath / ".notes.txt"
    for f in (dead, recent, unmarked, foreign):
        f.write_bytes(b"x" * 10)
    for f in (dead, recent):  # what fastckpt writes before the first byte of a temporary file
        pathlib.Path(mark_name(str(f))).write_bytes(mark_bytes(f.name))
    for f in (dead, pathlib.Path(mark_name(str(dead))), unmarked, foreign):
        os.utime(f, (1, 1))
    plugin = FastCheckpointIO({"orphan_grace_s": 600})
    callback = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
    make_trainer([callback], plugin, max_steps=2).fit(TinyModule(), ResumableBatches())
    assert not dead.exists() and not pathlib.Path(mark_name(str(dead))).exists()
    assert recent.exists() and unmarked.exists() and foreign.exists()
    assert (dirpath / "epoch=0-step=2.ckpt").exists()
    saved = torch.load(dirpath / "epoch=0-step=2.ckpt", weights_only=True)
    assert saved["global_step"] == 2
