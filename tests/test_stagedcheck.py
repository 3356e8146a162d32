"""The CRCs of a shared-memory snapshot taken in parallel before its record (fastckpt/engine/stagedcheck.py).

This VM has 2 CPUs, where the checker stays serial: the tests ask for 4 threads, so the parallel path is the one
run. The record must carry each tensor's CRC32C of the staged bytes (as the serial path took them), the checks run
on the checker's own named threads, a failing check fails that save once, and close() stops the threads.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import fastckpt.engine.stagedcheck as stagedcheck
from fastckpt import CheckpointConfig, Checkpointer, StorageError
from fastckpt.format.checksum import crc32c
from tests import shm_children as kids
from fastckpt.storage.local import LocalStorage
from tests.helpers import GatedStorage, assert_bit_equal, clone_state


@pytest.fixture
def four_threads(monkeypatch):
    monkeypatch.setattr(stagedcheck, "_threads", lambda: 4)
    seen: list[str] = []
    real = stagedcheck.check_staged

    def spy(job, shard):
        seen.append(threading.current_thread().name)
        return real(job, shard)

    monkeypatch.setattr(stagedcheck, "check_staged", spy)
    return seen


def _config(tmp_path: Path):
    """Health off: its pass on the I/O workers takes a shard's CRCs too (format/health.py) when it gets there first,
    and on a loaded machine it did, so the checker was handed fewer shards than the test meant to fail or watch."""
    cfg = kids.config(str(tmp_path / "ck"), str(tmp_path / "shm"))
    return CheckpointConfig(root=cfg.root, staging=cfg.staging, persist=cfg.persist, health={"enabled": False})


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(torch.randn(2, 64)).sum().backward()
    opt.step()
    return m, opt


def test_the_record_carries_the_staged_crcs_taken_in_parallel(tmp_path: Path, four_threads) -> None:
    (tmp_path / "shm").mkdir()
    m, opt = _model()
    gated = GatedStorage(LocalStorage(str(tmp_path / "ck"), fsync=False))  # the record stays until the gate opens
    with Checkpointer(_config(tmp_path), storage=gated) as ck:
        ck.watch(opt)
        state = {"m": m.state_dict()}
        ref = clone_state(state)
        h = ck.save(state, step=1)
        h.wait_staged()
        [record] = list((tmp_path / "shm").rglob("staged.json"))
        doc = json.loads(record.read_text())
        assert len(doc["crcs"]) > 1, "one shard: the parallel path was not taken"
        for index, crcs in doc["crcs"].items():
            data = Path(record.parent, f"shard-{int(index):05d}.bin").read_bytes()
            mine = [e for e in doc["entries"] if e[4] == int(index)]
            assert crcs == [crc32c(data[e[5]: e[5] + e[2]]) for e in mine]
        gated.gate.set()
        h.wait(timeout=60)
        assert_bit_equal(ref, ck.load(step=1))
        assert four_threads and all(n.startswith("fastckpt-crc-") for n in four_threads), four_threads
    assert not [t for t in threading.enumerate() if t.name.startswith("fastckpt-crc-")], "close() left them running"


def test_a_failing_check_fails_that_save_once_and_the_next_one_commits(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "shm").mkdir()
    monkeypatch.setattr(stagedcheck, "_threads", lambda: 4)
    real = stagedcheck.check_staged
    calls = {"n": 0}

    def failing_once(job, shard):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("injected: reading the staged shard failed")
        return real(job, shard)

    monkeypatch.setattr(stagedcheck, "check_staged", failing_once)
    m, opt = _model()
    with Checkpointer(_config(tmp_path)) as ck:
        ck.watch(opt)
        first = ck.save({"m": m.state_dict()}, step=1)
        first.wait_staged()
        with pytest.raises((StorageError, OSError), match="injected"):
            first.wait(timeout=60)
        ref = clone_state({"m": m.state_dict()})
        ck.save({"m": m.state_dict()}, step=2).wait(timeout=60)
        assert [c.step for c in ck.list()] == [2]
        assert_bit_equal(ref, ck.load(step=2))
