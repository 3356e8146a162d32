"""Lifecycle safety: frozen configs, the root lock, garbage collection of dead saves, loads racing re-saves."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import struct
import pickle
import re
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, ConfigError, IntegrityError, StorageError
from fastckpt.cli import main as cli_main
from fastckpt.storage.local import LocalStorage
from tests.dist_launcher import run_ranks
from tests.helpers import WrappedStorage

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


def test_forked_child_does_not_keep_the_lock_of_a_killed_parent(tmp_path) -> None:
    """A fork()ed child (a DataLoader worker) outliving its SIGKILLed parent must not keep the root locked."""
    script = textwrap.dedent("""
        import os, sys, torch
        from fastckpt import Checkpointer, CheckpointConfig
        ck = Checkpointer(CheckpointConfig(root=sys.argv[1]))
        ck.save({"x": torch.ones(2)}, step=1).wait(timeout=60)  # holds the root lock from here
        child = os.fork()
        if child == 0:
            sys.stdin.read()  # lingers until the test closes stdin
            os._exit(0)
        print("ready", child, flush=True)
        sys.stdin.read()  # until SIGKILL
    """)
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        child = int(parent.stdout.readline().split()[1])
        parent.kill()
        parent.wait(timeout=60)
        os.kill(child, 0)  # the child is still alive (raises if not)
        with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
            ckpt.save({"x": torch.ones(2)}, step=2).wait(timeout=60)
            assert [i.step for i in ckpt.list()] == [1, 2]
    finally:
        parent.stdin.close()  # the child's stdin too: it exits
        if parent.poll() is None:
            parent.kill()


# ---- garbage: folders of saves that died uncommitted --------------------------------------------------------


def _age(folder: Path, seconds: float) -> None:
    """Backdate every file in ``folder`` (what the grace period measures) by ``seconds``."""
    for f in folder.iterdir():
        st = f.stat()
        os.utime(f, (st.st_atime - seconds, st.st_mtime - seconds))


def test_killed_save_and_killed_retention_delete_are_collected(tmp_path, writers) -> None:
    killed_save = tmp_path / "save"
    writers(killed_save, "save").kill()  # died writing step 2
    dead = killed_save / "step-000000002"
    assert dead.is_dir() and "manifest.json" not in os.listdir(dead) and os.listdir(dead)

    killed_delete = tmp_path / "delete"
    writers(killed_delete, "delete").kill()  # died deleting step 1 (retention), after its manifest went
    half = killed_delete / "step-000000001"
    assert half.is_dir() and "manifest.json" not in os.listdir(half) and os.listdir(half)

    # a new Checkpointer collects at its first write (it then holds the root); a mere reader never does
    with Checkpointer(CheckpointConfig(root=str(killed_save), orphan_grace_s=0)) as reader:
        assert reader.latest() == 1 and reader.removed_orphans == [] and dead.is_dir()
    # within the grace period (default: an hour) nothing is proven dead
    with Checkpointer(CheckpointConfig(root=str(killed_save))) as ckpt:
        ckpt.save(STATE, step=3).wait(timeout=60)
        assert ckpt.removed_orphans == [] and dead.is_dir()
    _age(dead, 3601)
    with Checkpointer(CheckpointConfig(root=str(killed_save))) as ckpt:
        ckpt.save(STATE, step=4).wait(timeout=60)
        assert ckpt.removed_orphans == [str(dead)] and not dead.exists()
    with Checkpointer(CheckpointConfig(root=str(killed_save))) as ckpt:  # the good checkpoints are untouched
        assert [i.step for i in ckpt.list()] == [1, 3, 4]
        assert torch.equal(ckpt.load(1)["w"], STATE["w"]) and torch.equal(ckpt.load(1)["b"], STATE["b"])

    with Checkpointer(CheckpointConfig(root=str(killed_delete), orphan_grace_s=0)) as ckpt:
        ckpt.delete("step-000000002").result(timeout=60)  # a delete is a first write too
        assert ckpt.removed_orphans == [str(half)] and not half.exists()
        assert ckpt.list() == []


def test_a_resave_of_a_dead_folders_name_leaves_none_of_its_files(tmp_path, writers) -> None:
    """Resuming re-saves the step a killed run died in: the dead files go first, the new save commits alone."""
    writers(tmp_path, "save").kill()  # died writing step 2
    dead = tmp_path / "step-000000002"
    _age(dead, 7200)
    new = {"w": torch.full((4096,), 9.0), "b": torch.full((4096,), 8.0)}
    with Checkpointer(CheckpointConfig(root=str(tmp_path), orphan_grace_s=0)) as ckpt:
        ckpt.save(new, step=2).wait(timeout=60)
        assert ckpt.removed_orphans == [str(dead)]
        loaded = ckpt.load(2)
        assert torch.equal(loaded["w"], new["w"]) and torch.equal(loaded["b"], new["b"])
        listed = set(ckpt.reader(2).manifest["files"]) | {"manifest.json"}
    assert set(os.listdir(dead)) == listed  # no file of the dead save is left in the committed folder


def test_a_live_writers_folder_is_never_collected(tmp_path, writers) -> None:
    live = writers(tmp_path, "save")  # alive, holding the root, stuck in the middle of step 2
    folder = tmp_path / "step-000000002"
    _age(folder, 7200)  # even a folder that looks old: the lock proves its writer is alive
    with Checkpointer(CheckpointConfig(root=str(tmp_path), orphan_grace_s=0)) as ckpt:
        with pytest.raises(StorageError, match=f"pid {live.pid}"):
            ckpt.save(STATE, step=3)
        assert ckpt.removed_orphans == [] and folder.is_dir()
    assert cli_main(["gc", str(tmp_path), "--grace-s", "0"]) == 1  # refused: names the live holder
    assert folder.is_dir()
    live.kill()
    assert cli_main(["gc", str(tmp_path), "--grace-s", "0", "--dry-run"]) == 0 and folder.is_dir()
    assert cli_main(["gc", str(tmp_path), "--grace-s", "0"]) == 0 and not folder.exists()
    _assert_step1_intact(tmp_path)


def test_folders_that_are_not_fastckpt_saves_are_never_collected(tmp_path) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(STATE, step=1).wait(timeout=60)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.out").write_text("user data")
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "shard-00000.0123456789ab.safetensors").write_bytes(b"x")
    (tmp_path / "mixed" / "notes.txt").write_text("user data")
    (tmp_path / "empty").mkdir()
    (tmp_path / "pointer.ckpt").write_text("a file, not a folder")
    for folder in ("logs", "mixed"):
        _age(tmp_path / folder, 7200)
    with Checkpointer(CheckpointConfig(root=str(tmp_path), orphan_grace_s=0)) as ckpt:
        ckpt.delete("step-000000001").result(timeout=60)
        assert ckpt.removed_orphans == []
        ckpt.save(STATE, step=1).wait(timeout=60)
    assert sorted(os.listdir(tmp_path)) == [".fastckpt.lock", "empty", "logs", "mixed", "pointer.ckpt",
                                            "step-000000001"]
    _assert_step1_intact(tmp_path)


def test_orphan_grace_is_validated() -> None:
    for bad in (-1, "1h", True, float("inf")):
        with pytest.raises(ConfigError, match="orphan_grace_s"):
            CheckpointConfig(root="/x", orphan_grace_s=bad)
    assert CheckpointConfig(root="/x").orphan_grace_s == 3600
    assert CheckpointConfig.from_dict({"root": "/x", "orphan_grace_s": None}).orphan_grace_s is None


def test_object_store_orphans_are_collected_by_age_only(s3_root) -> None:
    """No locks on S3: a fresh uncommitted folder (a live writer elsewhere) is kept; an old one goes."""
    import fsspec

    fs = fsspec.filesystem("s3", **s3_root.storage_options)
    base = s3_root.url.removeprefix("s3://")
    cfg = CheckpointConfig(root=s3_root.url, storage_options=s3_root.storage_options)
    with Checkpointer(cfg) as ckpt:
        ckpt.save(STATE, step=1).wait(timeout=120)
    head = json.dumps({"__metadata__": {"format": "pt", "producer": "fastckpt", "step": "2"}}).encode()
    fs.pipe(f"{base}/step-000000002/shard-00000.0123456789ab.safetensors",  # another host, mid-save: its header
            struct.pack("<Q", len(head)) + head + b"partial")  # (what proves fastckpt wrote it) and some data
    with Checkpointer(cfg) as ckpt:
        ckpt.save(STATE, step=3).wait(timeout=120)
        assert ckpt.removed_orphans == []
    assert fs.exists(f"{base}/step-000000002/shard-00000.0123456789ab.safetensors")
    with Checkpointer(dataclasses.replace(cfg, orphan_grace_s=0)) as ckpt:  # older than the grace: dead
        ckpt.save(STATE, step=4).wait(timeout=120)
        assert ckpt.removed_orphans == [f"{s3_root.url}/step-000000002"]
        assert [i.step for i in ckpt.list()] == [1, 3, 4]
        assert torch.equal(ckpt.load(1)["b"], STATE["b"])
    fs.invalidate_cache()
    assert not fs.exists(f"{base}/step-000000002/shard-00000.0123456789ab.safetensors")


# ---- a load racing a re-save of the same name ------------------------------------------------------------------


class PausingStorage(WrappedStorage):
    """Pauses the first size check of a shard file (the reader holds the old manifest) until ``go``."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.reached = threading.Event()
        self.go = threading.Event()

    def size(self, path: str) -> int:
        if path.endswith(".safetensors") and not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(60)
        return self.inner.size(path)


def test_load_racing_a_resave_of_the_same_name_reads_the_new_checkpoint(tmp_path) -> None:
    old = {"w": torch.randn(256), "b": torch.randn(8)}
    new = {"w": torch.randn(256), "b": torch.randn(8)}
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as writer:
        writer.save(old, step=1, name="latest").wait(timeout=60)
        storage = PausingStorage(LocalStorage(str(tmp_path)))
        with Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=storage) as reader:
            with ThreadPoolExecutor(1, thread_name_prefix="test-loader") as pool:
                loading = pool.submit(reader.load, name="latest")
                assert storage.reached.wait(60)  # the reader read the old manifest and is about to read a shard
                writer.save(new, step=2, name="latest").wait(timeout=60)  # replaces it and removes the old files
                storage.go.set()
                loaded = loading.result(timeout=60)
    assert torch.equal(loaded["w"], new["w"]) and torch.equal(loaded["b"], new["b"])


def test_a_damaged_checkpoint_is_still_reported(tmp_path) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(STATE, step=1).wait(timeout=60)
        shard = next((tmp_path / "step-000000001").glob("*.safetensors"))
        shard.unlink()
        with pytest.raises(IntegrityError, match="missing; the checkpoint is damaged"):
            ckpt.load()


# ---- distributed ranks share one root; rank 0 holds the lock for all ------------------------------------------


def _ranks_are_refused(rank: int, world: int, root: str, holder: int) -> None:
    with pytest.raises(StorageError, match=rf"{'rank 0: ' if rank else ''}checkpoint root .* in use .*pid {holder}"):
        Checkpointer(CheckpointConfig(root=root), distributed=True)


def _ranks_write_together(rank: int, world: int, root: str) -> None:
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.arange(4096, dtype=torch.float32) * 2}
    with Checkpointer(CheckpointConfig(root=root), distributed=True) as ckpt:  # rank 1 never competes for the lock
        ckpt.save(state, step=3).wait(timeout=120)
        loaded = ckpt.load(3)
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])


@pytest.mark.slow
def test_distributed_ranks_share_a_root_and_are_refused_together(tmp_path, writers) -> None:
    holder = writers(tmp_path, "hold")
    run_ranks(_ranks_are_refused, 2, str(tmp_path), holder.pid)  # every rank raises: none hangs
    holder.close_checkpointer()
    run_ranks(_ranks_write_together, 2, str(tmp_path))
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        assert [i.step for i in ckpt.list()] == [1, 3]
