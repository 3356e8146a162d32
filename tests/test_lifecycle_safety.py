"""Lifecycle safety: frozen configs, the root lock, garbage collection of dead saves, loads racing re-saves."""
from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, ConfigError, StorageError

REPO = Path(__file__).resolve().parents[1]


# ---- configs are frozen once a Checkpointer holds them -----------------------------------------------------


def test_mutating_a_config_in_use_raises_naming_the_field(tmp_path) -> None:
    cfg = CheckpointConfig(root=str(tmp_path), staging={"slots": 2})
    with Checkpointer(cfg) as ckpt:
        with pytest.raises(ConfigError, match=r"staging\.slots cannot change.*dataclasses\.replace"):
            cfg.staging.slots = 0
        with pytest.raises(ConfigError, match=r"retention\.keep_last cannot change"):
            cfg.retention.keep_last = 1
        with pytest.raises(ConfigError, match=r"^root cannot change"):
            cfg.root = str(tmp_path / "elsewhere")
        assert cfg.staging.slots == 2 and cfg.root == str(tmp_path)
        state = {"w": torch.randn(16, 16)}
        ckpt.save(state, step=1).wait(timeout=60)  # still consistent: save() commits
        assert torch.equal(ckpt.load()["w"], state["w"])


def test_copies_of_a_config_in_use_are_new_configs(tmp_path) -> None:
    cfg = CheckpointConfig(root=str(tmp_path / "a"))
    with Checkpointer(cfg):
        other = dataclasses.replace(cfg, root=str(tmp_path / "b"))  # the sections are copied too
        other.staging.slots = 3
        other.retention.keep_last = 2
        assert cfg.staging.slots == 2 and cfg.retention.keep_last is None
        for clone in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
            assert clone == cfg and not clone.frozen
            clone.staging.slots = 5
        with Checkpointer(other) as second:
            assert second.config.staging.slots == 3
            with pytest.raises(ConfigError, match=r"staging\.slots"):
                other.staging.slots = 1
    assert CheckpointConfig.from_dict(cfg.to_dict()) == cfg  # the flag is not part of the schema


# ---- helpers: a writer in another process ------------------------------------------------------------------


class Writer:
    """``tests.lifecycle_child`` in a subprocess; synchronized on its stdout lines."""

    def __init__(self, root: Path, mode: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.lifecycle_child", str(root), mode], cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # blocks until the child reports (or dies: then "")
        assert line.split()[:1] in (["holding"], ["stuck"]), (line, self.proc.stderr.read() if not line else "")
        self.pid = int(line.split()[1])

    def close_checkpointer(self) -> None:
        self.proc.stdin.write("close\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "closed"

    def kill(self) -> None:
        self.proc.kill()  # SIGKILL: no exit hook, no close()
        self.proc.wait(timeout=60)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def writers():
    started: list[Writer] = []

    def start(root: Path, mode: str) -> Writer:
        started.append(Writer(root, mode))
        return started[-1]

    yield start
    for w in started:
        w.end()


STATE = {"w": torch.full((4096,), 1.0), "b": torch.full((4096,), 2.0)}


def _assert_step1_intact(root: Path) -> None:
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
        assert [i.step for i in ckpt.list()] == [1]
        loaded = ckpt.load(1)
        assert torch.equal(loaded["w"], STATE["w"]) and torch.equal(loaded["b"], STATE["b"])


# ---- one writer per root -----------------------------------------------------------------------------------


def test_second_writer_is_refused_naming_root_and_holder(tmp_path, writers) -> None:
    holder = writers(tmp_path, "hold")
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as reader:  # readers never need the lock
        assert reader.latest() == 1 and torch.equal(reader.load()["w"], STATE["w"])
        with pytest.raises(StorageError, match=rf"{re.escape(str(tmp_path))} is in use by another writer \(pid "
                                                rf"{holder.pid} on host .*stop the other process"):
            reader.save({"x": torch.ones(2)}, step=5)
        with pytest.raises(StorageError, match=f"pid {holder.pid}"):
            reader.delete("step-000000001")
    # a second process gets the same error
    second = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys, torch
        from fastckpt import Checkpointer, CheckpointConfig, StorageError
        ck = Checkpointer(CheckpointConfig(root=sys.argv[1]))
        try:
            ck.save({"x": torch.ones(2)}, step=5)
        except StorageError as e:
            print("refused:", e)
    """), str(tmp_path)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=120)
    assert f"refused: checkpoint root {tmp_path} is in use by another writer (pid {holder.pid}" in second.stdout, second
    holder.close_checkpointer()  # released on close: this process may write now
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save({"x": torch.ones(2)}, step=5).wait(timeout=60)
        assert ckpt.latest() == 5


def test_lock_is_released_when_the_holder_is_sigkilled(tmp_path, writers) -> None:
    holder = writers(tmp_path, "hold")
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        with pytest.raises(StorageError, match=f"pid {holder.pid}"):
            ckpt.save({"x": torch.ones(2)}, step=5)
        holder.kill()
        ckpt.save({"x": torch.ones(2)}, step=5).wait(timeout=60)  # the kernel dropped the dead holder's lock
        assert [i.step for i in ckpt.list()] == [1, 5]


def test_two_checkpointers_of_one_process_cannot_both_write_a_root(tmp_path) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as first:
        first.save({"x": torch.ones(2)}, step=1).wait(timeout=60)
        with Checkpointer(CheckpointConfig(root=str(tmp_path))) as second:
            assert second.latest() == 1
            with pytest.raises(StorageError, match=f"pid {os.getpid()}"):
                second.save({"x": torch.ones(2)}, step=2)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as third:
        third.save({"x": torch.ones(2)}, step=2).wait(timeout=60)


def test_forked_child_does_not_keep_the_lock(tmp_path) -> None:
    """A fork()ed child that outlives its parent's Checkpointer must not keep the root locked."""
    ckpt = Checkpointer(CheckpointConfig(root=str(tmp_path)))
    ckpt.save({"x": torch.ones(2)}, step=1).wait(timeout=60)
    ctx = multiprocessing.get_context("fork")
    release = ctx.Event()
    child = ctx.Process(target=release.wait, args=(120,), name="lingering-child")
    child.start()
    try:
        ckpt.close()  # the parent lets go while the child still runs
        with Checkpointer(CheckpointConfig(root=str(tmp_path))) as again:
            again.save({"x": torch.ones(2)}, step=2).wait(timeout=60)
    finally:
        release.set()
        child.join(60)
    assert child.exitcode == 0
