"""Retention keeps the right checkpoints and never touches pending or newest ones."""
from __future__ import annotations

import torch

from fastckpt.storage.protocol import open_storage
from fastckpt import CheckpointConfig, Checkpointer
from tests.helpers import GatedStorage


def _cfg(tmp_path, **retention) -> CheckpointConfig:
    return CheckpointConfig(root=str(tmp_path), retention=retention)


def test_keep_last(tmp_path) -> None:
    with Checkpointer(_cfg(tmp_path, keep_last=2)) as ckpt:
        for step in range(1, 6):
            ckpt.save({"x": torch.tensor(step)}, step=step).wait()
        assert [i.step for i in ckpt.list()] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fastckpt.lock", "step-000000004", "step-000000005"]


def test_keep_every_n_steps(tmp_path) -> None:
    with Checkpointer(_cfg(tmp_path, keep_last=1, keep_every_n_steps=4)) as ckpt:
        for step in range(1, 10):
            ckpt.save({"x": torch.tensor(step)}, step=step).wait()
        assert [i.step for i in ckpt.list()] == [4, 8, 9]


def test_retention_never_deletes_pending_or_newest(tmp_path) -> None:
    gated = GatedStorage(open_storage(str(tmp_path)))
    gated.gate.set()
    with Checkpointer(_cfg(tmp_path, keep_last=1), storage=gated) as ckpt:
        ckpt.save({"x": torch.tensor(1)}, step=1).wait()
        gated.gate.clear()
        pending = ckpt.save({"x": torch.tensor(2)}, step=2)
        assert gated.entered.wait(10)
        # an explicit delete queued now must wait behind the pending save
        fut = ckpt.delete("step-000000001")
        assert not fut.done()
        assert ckpt.latest() == 1  # still the newest committed: retention left it alone
        gated.gate.set()
        pending.wait()
        fut.result(10)
        assert [i.step for i in ckpt.list()] == [2]


def test_delete_is_queued_behind_saves(tmp_path) -> None:
    gated = GatedStorage(open_storage(str(tmp_path)))
    with Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=gated) as ckpt:
        h = ckpt.save({"x": torch.tensor(1)}, step=1, name="a")
        fut = ckpt.delete("a")  # the save is pending: the delete runs after it commits
        assert gated.entered.wait(10) and not fut.done()
        gated.gate.set()
        h.wait()
        fut.result(10)
        assert not ckpt.exists("a")
        assert not (tmp_path / "a").exists()
