"""Threads, close(), interpreter exit."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, ConfigError, FastCkptError

ROOT = Path(__file__).resolve().parents[1]


def _fastckpt_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("fastckpt")}


def test_threads_are_named_and_stop_on_close(tmp_path) -> None:
    before = _fastckpt_threads()
    ckpt = Checkpointer(CheckpointConfig(root=str(tmp_path)))
    ckpt.save({"x": torch.ones(3)}, step=1)
    names = _fastckpt_threads() - before
    assert {n.rsplit("-", 1)[0] for n in names} >= {"fastckpt-copy", "fastckpt-commit"}
    ckpt.close()
    ckpt.close()  # idempotent
    assert _fastckpt_threads() - before == set()
    with pytest.raises(FastCkptError, match="closed"):
        ckpt.save({"x": torch.ones(3)}, step=2)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as again:
        assert again.latest() == 1


def test_close_is_safe_after_failed_init(tmp_path) -> None:
    with pytest.raises(ConfigError):
        Checkpointer("not a config")  # type: ignore[arg-type]


def test_bad_names_and_steps(tmp_path) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        for bad in ("", "a/b", ".hidden", ".."):
            with pytest.raises(ConfigError, match="name"):
                ckpt.save({"x": torch.ones(1)}, step=1, name=bad)
        with pytest.raises(ConfigError, match="step"):
            ckpt.save({"x": torch.ones(1)}, step=-1)


def test_pending_save_is_flushed_at_interpreter_exit(tmp_path) -> None:
    script = textwrap.dedent("""
        import sys, torch
        from fastckpt import Checkpointer, CheckpointConfig
        ck = Checkpointer(CheckpointConfig(root=sys.argv[1], persist={"chunk_bytes": 65536}))
        model = torch.nn.Linear(512, 512, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ck.watch(opt)  # lazy: the copy thread still has work when the interpreter exits
        with torch.no_grad():
            model.weight.fill_(7.0)
        ck.save({"w": model.weight, "eager": torch.ones(3)}, step=42)
        # no wait(), no close(): the exit hook must flush
    """)
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "flushing 1 pending checkpoint" in r.stderr
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        assert ckpt.latest() == 42
        assert torch.equal(ckpt.load()["w"], torch.full((512, 512), 7.0))


def test_core_import_pulls_in_no_integration() -> None:
    """`import fastckpt` must not import Lightning or Accelerate (they are optional extras)."""
    code = ("import sys, fastckpt, fastckpt.cli; "
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'accelerate', 's3fs') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, f"core import pulled in {r.stdout.strip()} {r.stderr[-500:]}"


def _policy(tid: int) -> tuple[int, int]:
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="per-thread scheduling policies are Linux-only")
@pytest.mark.parametrize("priority", ["idle", "low", "normal", None])
def test_background_threads_run_at_the_configured_priority(tmp_path, priority: str | None) -> None:
    """persist.priority reaches the kernel for the I/O and commit threads; the copy thread, which the next
    optimizer step waits for, keeps the training thread's priority. None: the default leaves every thread at the
    training thread's priority (a lowered thread preempted while it holds the GIL stalls training on a busy host)."""
    main = _policy(threading.get_native_id())
    before = {t.native_id for t in threading.enumerate()}
    persist = {"workers": 1} if priority is None else {"priority": priority, "workers": 1}
    cfg = CheckpointConfig.from_dict({"root": str(tmp_path), "persist": persist})
    with Checkpointer(cfg) as ckpt:
        ckpt.save({"x": torch.ones(1 << 16)}, step=1).wait()  # the I/O pool starts its threads lazily
        # wait() raised them while it blocked on them; a save that finds nothing pending lowers them again
        second = ckpt.save({"x": torch.ones(1 << 16)}, step=2)
        # "fastckpt-copy-3", "fastckpt-commit-3", "fastckpt-io-3_0" -> kind
        got = {t.name.rsplit("-", 1)[0]: _policy(t.native_id) for t in threading.enumerate()
               if t.name.startswith("fastckpt-") and t.native_id not in before}
        second.wait()
    want = {"idle": (os.SCHED_IDLE, main[1]), "low": (os.SCHED_OTHER, 19), "normal": main, None: main}[priority]
    assert got["fastckpt-io"] == want and got["fastckpt-commit"] == want, got
    assert got["fastckpt-copy"] == main, got
