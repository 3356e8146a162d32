"""A fork()ed child (DataLoader worker, 'fork' Process) never flushes or waits for its parent's saves."""
from __future__ import annotations

import logging
import multiprocessing
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fastckpt import CheckpointConfig, Checkpointer, FastCkptError
from fastckpt.storage.local import LocalStorage
from tests.helpers import GatedStorage

ROOT = Path(__file__).resolve().parents[1]
# Generous: a child that returns at once exits in milliseconds; one that flushes would wait for
# the parent's blocked storage (the exit flush waits up to 300 s), so a passing child never nears it.
_CHILD_EXIT_BOUND_S = 60.0

_fork = multiprocessing.get_context("fork")


@pytest.fixture
def blocked(tmp_path):
    """A Checkpointer whose save is pending on storage that blocks until the test opens the gate."""
    storage = GatedStorage(LocalStorage(str(tmp_path)))
    ckpt = Checkpointer(CheckpointConfig(root=str(tmp_path), staging={"mode": "eager"}), storage=storage)
    state = {"w": torch.randn(64, 64), "step": torch.tensor(3)}
    handle = ckpt.save(state, step=3)
    assert storage.entered.wait(30), "the save never reached the storage"
    assert not handle.done()
    yield ckpt, state
    storage.gate.set()
    ckpt.close()


def _child_that_returns() -> None:
    return None


def _child_that_uses(ckpt: Checkpointer, out: "multiprocessing.connection.Connection") -> None:
    ckpt.wait()  # the parent's saves are not the child's: returns at once
    ckpt.wait_staged()
    try:
        ckpt.save({"x": torch.ones(1)}, step=9)
    except FastCkptError as e:
        out.send(str(e))


def _assert_saved_after_release(ckpt: Checkpointer, state: dict) -> None:
    ckpt.storage.gate.set()
    ckpt.wait()
    assert torch.equal(ckpt.load()["w"], state["w"])


def _assert_child_exits(name: str, hung: str) -> None:
    """Fork a child with nothing to do; it must exit 0 within the bound (killed and reaped if it does not)."""
    child = _fork.Process(target=_child_that_returns, name=name)
    child.start()
    child.join(_CHILD_EXIT_BOUND_S)
    try:
        assert child.exitcode == 0, hung
    finally:
        if child.exitcode is None:
            child.kill()
            child.join()


def test_forked_process_exits_at_once_while_parent_save_pends(blocked) -> None:
    ckpt, state = blocked
    _assert_child_exits("fork-child", "the fork()ed child hung in the parent's exit flush")
    _assert_saved_after_release(ckpt, state)


def test_forked_child_does_not_wait_and_cannot_save(blocked) -> None:
    ckpt, state = blocked
    recv, send = _fork.Pipe(duplex=False)
    child = _fork.Process(target=_child_that_uses, args=(ckpt, send), name="fork-user")
    child.start()
    child.join(_CHILD_EXIT_BOUND_S)
    try:
        assert child.exitcode == 0
        assert recv.poll(0), "save() in a fork()ed child did not raise"
        message = recv.recv()
        assert f"belongs to process {os.getpid()}" in message and "create a new Checkpointer" in message
    finally:
        if child.exitcode is None:
            child.kill()
            child.join()
    _assert_saved_after_release(ckpt, state)


def test_dataloader_workers_exit_cleanly_while_parent_save_pends(blocked, tmp_path) -> None:
    ckpt, state = blocked
    # Workers inherit this handler: a worker that ran the parent's exit flush would log it here.
    record = logging.FileHandler(tmp_path / "fastckpt.log")
    record.setFormatter(logging.Formatter("%(process)d %(message)s"))
    logger = logging.getLogger("fastckpt")
    logger.addHandler(record)
    try:
        data = TensorDataset(torch.arange(8, dtype=torch.float32))
        loader = DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context="fork")
        it = iter(loader)
        assert torch.equal(torch.cat([b[0] for b in it]), torch.arange(8, dtype=torch.float32))
        workers = list(it._workers)
        it._shutdown_workers()  # joins each worker; one still running after 5 s is terminated
    finally:
        logger.removeHandler(record)
        record.close()
    assert [w.exitcode for w in workers] == [0, 0]
    lines = (tmp_path / "fastckpt.log").read_text().splitlines()
    assert not [line for line in lines if "flushing" in line], f"a DataLoader worker ran the exit flush: {lines}"
    _assert_saved_after_release(ckpt, state)


def test_os_fork_child_interpreter_exit_is_prompt(tmp_path) -> None:
    """A bare os.fork() child that ends with a normal interpreter exit (atexit, __del__) returns at once."""
    script = textwrap.dedent("""
        import os, sys, threading, torch
        from fastckpt import Checkpointer, CheckpointConfig
        from fastckpt.storage.local import LocalStorage
        from tests.helpers import GatedStorage

        storage = GatedStorage(LocalStorage(sys.argv[1]))
        ck = Checkpointer(CheckpointConfig(root=sys.argv[1], staging={"mode": "eager"}), storage=storage)
        ck.save({"w": torch.full((32,), 5.0)}, step=1)
        assert storage.entered.wait(30)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # full interpreter exit in the child: exit hooks and __del__ run here
        # bounded wait for the child: a watchdog thread kills it if it is still there after the bound
        done = threading.Event()
        def watchdog():
            if not done.wait(float(sys.argv[2])):
                os.kill(pid, 9)
        threading.Thread(target=watchdog, daemon=True).start()
        _, status = os.waitpid(pid, 0)
        done.set()
        print("child-status", status, flush=True)
        storage.gate.set()
        ck.close()
    """)
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(_CHILD_EXIT_BOUND_S)], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "child-status 0" in r.stdout, (r.stdout, r.stderr)
    assert "flushing" not in r.stderr  # only the parent flushes, and it closed explicitly
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        assert torch.equal(ckpt.load()["w"], torch.full((32,), 5.0))


def test_accelerate_exit_hook_does_not_run_in_a_forked_child(tmp_path) -> None:
    """Accelerate's own exit hook (close at exit) must not flush the parent's pending save_state in a child."""
    pytest.importorskip("accelerate")
    import fastckpt_accelerate
    from accelerate_testing import GatedStorage as AccGatedStorage
    from accelerate_testing import Setup, make_accelerator, reset_accelerate

    acc = make_accelerator(tmp_path)
    storage = AccGatedStorage(str(tmp_path / "checkpoints"))
    checkpointing = fastckpt_accelerate.enable(acc, None, storage=storage)
    try:
        setup = Setup(acc)
        setup.step()
        storage.gate.clear()
        acc.save_state()
        checkpointing.checkpointer.wait_staged()  # the seal: Accelerate's files are written from then on
        assert storage.write_started.wait(30)
        _assert_child_exits("fork-child-accelerate", "the fork()ed child hung in Accelerate's exit hook")
        storage.gate.set()
        checkpointing.wait()
        assert checkpointing.checkpointer.exists("checkpoint_0")
    finally:
        storage.gate.set()
        checkpointing.close()
        reset_accelerate()
