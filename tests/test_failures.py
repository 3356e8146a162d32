"""Failure paths: faulty storage, corruption, foreign files, malicious pickles, SIGKILL."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastckpt
from fastckpt.format.checksum import crc32c
from fastckpt.storage.protocol import open_storage
from fastckpt import (
    CheckpointConfig,
    Checkpointer,
    CheckpointNotFoundError,
    IntegrityError,
    StateMismatchError,
    StorageError,
    UnsafeCheckpointError,
)
from tests.helpers import FaultyStorage, assert_bit_equal

ROOT = Path(__file__).resolve().parents[1]


def _state(v: float) -> dict:
    return {"w": torch.full((64, 64), v), "b": torch.full((64,), v), "step": int(v)}


def _local(tmp_path: Path) -> CheckpointConfig:
    return CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 8192})


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EACCES])
def test_faulty_storage_error_raised_once_and_previous_survives(tmp_path, err: int) -> None:
    cfg = _local(tmp_path)
    faulty = FaultyStorage(open_storage(cfg.root), fail_on=10**9, err=err)
    with Checkpointer(cfg, storage=faulty) as ckpt:
        ckpt.save(_state(1.0), step=1).wait()
        faulty.writes, faulty.fail_on = 0, 1  # the next save's first file fails half-written
        h = ckpt.save(_state(2.0), step=2)
        with pytest.raises(StorageError) as ei:
            ckpt.wait()
        assert "shard-" in str(ei.value) and str(tmp_path) in str(ei.value)  # names the path
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == err
        assert h.done()
        ckpt.wait()  # raised once: not again
        ckpt.save(_state(3.0), step=3).wait()  # not raised by the next save either
        assert [i.step for i in ckpt.list()] == [1, 3]
        assert_bit_equal(_state(1.0), ckpt.load(step=1))
    assert not (tmp_path / "step-000000002" / "manifest.json").exists()
    leftovers = list((tmp_path / "step-000000002").glob("*")) if (tmp_path / "step-000000002").exists() else []
    assert leftovers == [], f"partial files left behind: {leftovers}"


def test_background_error_surfaces_at_next_save(tmp_path) -> None:
    cfg = _local(tmp_path)
    faulty = FaultyStorage(open_storage(cfg.root), fail_on=1)
    ckpt = Checkpointer(cfg, storage=faulty)
    h = ckpt.save(_state(1.0), step=1)
    h._durable.exception()  # wait for the failure without consuming it
    with pytest.raises(StorageError):
        ckpt.save(_state(2.0), step=2)
    ckpt.save(_state(3.0), step=3).wait()
    assert ckpt.latest() == 3
    ckpt.close()


def test_background_error_surfaces_at_close(tmp_path) -> None:
    cfg = _local(tmp_path)
    ckpt = Checkpointer(cfg, storage=FaultyStorage(open_storage(cfg.root), fail_on=1))
    ckpt.save(_state(1.0), step=1)
    with pytest.raises(StorageError):
        ckpt.close()
    ckpt.close()  # idempotent, and the error is not raised twice


def test_handle_wait_consumes_the_error(tmp_path) -> None:
    cfg = _local(tmp_path)
    ckpt = Checkpointer(cfg, storage=FaultyStorage(open_storage(cfg.root), fail_on=1))
    h = ckpt.save(_state(1.0), step=1)
    with pytest.raises(StorageError):
        h.wait()
    ckpt.close()  # already reported through the handle


def _saved(tmp_path: Path) -> Path:
    with Checkpointer(_local(tmp_path)) as ckpt:
        ckpt.save(_state(1.0), step=1).wait()
        ckpt.save(_state(2.0), step=2).wait()
    return tmp_path / "step-000000002"


def test_flipped_byte_names_file_and_tensor(tmp_path) -> None:
    d = _saved(tmp_path)
    shard = sorted(d.glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x01  # inside the last tensor's bytes
    shard.write_bytes(bytes(data))
    with Checkpointer(_local(tmp_path)) as ckpt:
        with pytest.raises(IntegrityError) as ei:
            ckpt.load(step=2)
        assert shard.name in str(ei.value) and "tensor" in str(ei.value)
        assert_bit_equal(_state(1.0), ckpt.load(step=1))  # the earlier checkpoint is untouched


def test_truncated_file_is_reported(tmp_path) -> None:
    d = _saved(tmp_path)
    shard = sorted(d.glob("shard-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(IntegrityError, match="truncated"):
        fastckpt.load_checkpoint(str(d))


def test_missing_manifest_is_invisible(tmp_path) -> None:
    d = _saved(tmp_path)
    (d / "manifest.json").unlink()
    with Checkpointer(_local(tmp_path)) as ckpt:
        assert ckpt.latest() == 1
        with pytest.raises(CheckpointNotFoundError, match="manifest.json is missing"):
            ckpt.load(name="step-000000002")


def test_foreign_manifest_is_rejected(tmp_path) -> None:
    d = _saved(tmp_path)
    (d / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(IntegrityError, match="not a fastckpt manifest"):
        fastckpt.load_checkpoint(str(d))
    (d / "manifest.json").write_bytes(b"\x00\x01garbage")
    with pytest.raises(IntegrityError, match="manifest.json"):
        fastckpt.load_checkpoint(str(d))


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch EVIL_RAN",))


def test_malicious_pickle_is_refused_and_not_executed(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = CheckpointConfig(root=str(tmp_path), allowed_classes=["builtins.slice"])
    with Checkpointer(cfg) as ckpt:
        ckpt.save({"w": torch.ones(2), "obj": slice(1, 2)}, step=1).wait()
        assert ckpt.load()["obj"] == slice(1, 2)  # allowlisted classes round-trip
    d = tmp_path / "step-000000001"
    obj_file = next(d.glob("objects.*.pt"))
    import io

    buf = io.BytesIO()
    torch.save([_Evil()], buf)
    obj_file.write_bytes(buf.getvalue())
    # forge the manifest so only the unpickler stands in the way
    man = json.loads((d / "manifest.json").read_text())
    man["files"][obj_file.name] = {"size": len(buf.getvalue()), "crc32c": crc32c(buf.getvalue())}
    (d / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(UnsafeCheckpointError, match="allowed_classes"):
        fastckpt.load_checkpoint(str(d), allowed_classes=["builtins.slice"])
    assert not (tmp_path / "EVIL_RAN").exists()


class Custom:
    pass


def test_unloadable_object_fails_at_save_time(tmp_path) -> None:
    with Checkpointer(_local(tmp_path)) as ckpt:
        with pytest.raises(UnsafeCheckpointError, match="allowed_classes"):
            ckpt.save({"x": Custom()}, step=0)
        with pytest.raises(UnsafeCheckpointError, match="cannot be serialized"):
            ckpt.save({"x": lambda: 1}, step=0)
        assert ckpt.latest() is None


def test_load_into_mismatch_names_the_tensor(tmp_path) -> None:
    _saved(tmp_path)
    with Checkpointer(_local(tmp_path)) as ckpt:
        with pytest.raises(StateMismatchError, match="'w'"):
            ckpt.load_into({"w": torch.zeros(3, 3), "b": torch.zeros(64), "step": 0})
        with pytest.raises(StateMismatchError, match="not in the checkpoint"):
            ckpt.load_into({"w": torch.zeros(64, 64), "extra": torch.zeros(1)})
        partial = ckpt.load_into({"w": torch.zeros(64, 64)})  # the rest is loaded fresh
        assert_bit_equal(_state(2.0), partial)


def test_no_checkpoint_gives_clear_error(tmp_path) -> None:
    with Checkpointer(_local(tmp_path)) as ckpt:
        with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
            ckpt.load()


_KILL_SCRIPT = textwrap.dedent("""
    import os, sys, signal, threading, torch
    from fastckpt import Checkpointer, CheckpointConfig
    from fastckpt.storage.local import LocalStorage
    root = sys.argv[1]
    class Stall(LocalStorage):
        def write_atomic(self, path, data):
            print("COMMITTING", flush=True)
            threading.Event().wait()  # stand still at the commit point until SIGKILL
    ck = Checkpointer(CheckpointConfig(root=root))
    ck.save({"w": torch.full((256, 256), 1.0)}, step=1).wait()
    ck.close()  # one writer per root: the next one may write once this one is closed
    ck2 = Checkpointer(CheckpointConfig(root=root), storage=Stall(root))
    ck2.save({"w": torch.full((256, 256), 2.0)}, step=2)
    threading.Event().wait()
""")


def test_sigkill_mid_save_leaves_previous_checkpoint_loadable(tmp_path) -> None:
    script = tmp_path / "kill.py"
    script.write_text(_KILL_SCRIPT)
    root = tmp_path / "ckpts"
    proc = subprocess.Popen([sys.executable, str(script), str(root)], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()  # the child reached the commit point of step 2
        assert line.strip() == "COMMITTING"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    assert (root / "step-000000002").exists()  # its data files were written...
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
        assert ckpt.latest() == 1  # ...but it never committed
        assert torch.equal(ckpt.load()["w"], torch.full((256, 256), 1.0))
