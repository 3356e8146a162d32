"""A constructor that raises leaves nothing behind (issue 54 item 3): no thread, no process group, no signal handler,
no held root. What the config alone refuses is refused before anything starts; a later failure undoes what started."""
from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, ConfigError, LocalStorage, StorageError
from tests.helpers import assert_bit_equal, run_child


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("fastckpt")}


def _on_a_thread(fn: Any) -> BaseException | None:
    """Run ``fn`` on a thread that is not the main one; what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            raised.append(e)

    t = threading.Thread(target=run, name="not-main")
    t.start()
    t.join(120)
    assert not t.is_alive()
    return raised[0] if raised else None


def _usable(root: Path) -> None:
    """The root is not held: another Checkpointer saves into it and reads back."""
    state = {"w": torch.arange(6.0)}
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
        ckpt.save(state, 1).wait()
        assert_bit_equal(ckpt.load(), state)


def test_preemption_off_the_main_thread_is_refused_before_any_thread_starts(tmp_path) -> None:
    before, handler = _threads(), signal.getsignal(signal.SIGTERM)
    cfg = CheckpointConfig.from_dict({"root": str(tmp_path / "r"), "preemption": {"enabled": True}})
    err = _on_a_thread(lambda: Checkpointer(cfg))
    assert isinstance(err, ConfigError) and "main thread" in str(err) and "preemption.enabled" in str(err)
    assert _threads() == before  # the copy and commit threads were never started
    assert signal.getsignal(signal.SIGTERM) == handler
    _usable(tmp_path / "r")


class _ListingFails(LocalStorage):
    """A root that answers the construction's check, then fails to list (a disk gone bad)."""

    def listdir(self, path: str) -> list[str]:
        raise StorageError(f"injected: cannot list {path}")


def test_a_failure_after_the_threads_started_stops_them_and_frees_the_root(tmp_path) -> None:
    before = _threads()
    root = tmp_path / "r"
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:  # a checkpoint the remote tier lacks
        ckpt.save({"w": torch.ones(3)}, 1).wait()
    remote = LocalStorage(str(tmp_path / "remote"))
    with pytest.raises(StorageError, match="injected"):  # resume_uploads, after the upload threads started
        Checkpointer(CheckpointConfig(root=str(root)), storage=_ListingFails(str(root)), remote_storage=remote)
    assert _threads() == before  # copy, commit, io and upload threads all stopped
    _usable(root)


DISTRIBUTED_CHILD = r"""
import os, sys, threading
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from fastckpt import CheckpointConfig, Checkpointer, ConfigError
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store", rank=0, world_size=1)
groups = c10d.get_pg_count()
threads = {t.name for t in threading.enumerate()}
try:
    Checkpointer(CheckpointConfig.from_dict({"root": sys.argv[1] + "/r", "staging": {"when_busy": "skip"}}),
                 distributed=True)
except ConfigError as e:
    print("refused", "when_busy" in str(e))
print("groups", c10d.get_pg_count() - groups)
print("threads", sorted({t.name for t in threading.enumerate()} - threads))
dist.destroy_process_group()
"""


def test_when_busy_skip_with_distributed_is_refused_before_the_private_group(tmp_path) -> None:
    out = run_child(DISTRIBUTED_CHILD, str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["refused True", "groups 0", "threads []"], out.stdout


def test_accelerate_enable_off_the_main_thread_is_refused_before_any_thread_starts(tmp_path) -> None:
    pytest.importorskip("accelerate", reason="the Accelerate integration needs accelerate installed")
    from accelerate import Accelerator

    from fastckpt_accelerate import enable, get_checkpointing

    accelerator = Accelerator(cpu=True)
    before = _threads()
    err = _on_a_thread(lambda: enable(accelerator, {"root": str(tmp_path / "r"), "preemption": {"enabled": True}}))
    assert isinstance(err, ConfigError) and "main thread" in str(err)
    assert _threads() == before and get_checkpointing(accelerator) is None
    _usable(tmp_path / "r")


def test_a_failure_while_the_saver_wires_its_started_pipeline_stops_its_threads(tmp_path, monkeypatch) -> None:
    """The Saver starts the pipeline's copy and commit threads, then places them (persist.background_cpus): a
    failure there (an OS refusing the affinity call it makes) stops them before the constructor raises."""
    from fastckpt.engine.affinity import ThreadPlacement

    def refuse(self, *args: Any, **kwargs: Any) -> None:
        raise OSError("injected: sched_setaffinity refused")

    monkeypatch.setattr(ThreadPlacement, "follow", refuse)
    before = _threads()
    with pytest.raises(OSError, match="injected"):
        Checkpointer(CheckpointConfig(root=str(tmp_path / "r")))
    assert _threads() == before
    monkeypatch.undo()
    _usable(tmp_path / "r")
