"""Ring-mode staging (``staging.max_host_bytes`` below the state's size) when writes fail.

A failed write used to keep its ring buffer: the copier (``save()`` itself when eager, the copy thread behind the
optimizer's step pre-hook when lazy) then waited forever for a buffer that nothing would free. Every wait here is
bounded (a daemon thread and a future with a timeout), so a regression fails instead of hanging the suite.
"""
from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, StorageError
from fastckpt.storage.protocol import open_storage
from tests.helpers import WrappedStorage, assert_bit_equal, bounded, clone_state

LIMIT = 512 * 1024  # two ring buffers of one 256 KiB shard each


class BrokenDisk(WrappedStorage):
    """Every data write fails (a full disk) while ``broken`` is set, after writing half of it."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.broken = threading.Event()
        self.broken.set()
        self.failed = 0

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        if self.broken.is_set():
            self.failed += 1
            self.inner.write_file(path, [parts[0][: max(1, len(parts[0]) // 2)]])  # a torn file stays behind
            raise OSError(errno.ENOSPC, "injected: ENOSPC", path)
        self.inner.write_file(path, parts)


def _config(root: Path, mode: str) -> CheckpointConfig:
    return CheckpointConfig(root=str(root), staging={"max_host_bytes": LIMIT, "mode": mode},
                            persist={"chunk_bytes": 256 * 1024})


def _no_files_of(root: Path, name: str) -> None:
    folder = root / name
    left = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    assert left == [], f"the failed save left files behind: {left}"


def test_eager_ring_write_failure_raises_once_and_next_save_completes(tmp_path) -> None:
    state = {f"t{i}": torch.randn(64, 1024) for i in range(8)}  # 8 shards of 256 KiB through 2 ring buffers
    ref = clone_state(state)
    disk = BrokenDisk(open_storage(str(tmp_path)))
    ckpt = Checkpointer(_config(tmp_path, "eager"), storage=disk)
    try:
        # Both ring buffers go to writes that fail; the third shard's copy used to wait for them forever.
        with pytest.raises(StorageError) as ei:
            bounded(lambda: ckpt.save(state, step=0))
        assert "step-000000000" in str(ei.value) and "shard-" in str(ei.value), ei.value  # names the file
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ENOSPC
        assert disk.failed <= 2, "save() went on copying and writing after the snapshot was lost"
        bounded(ckpt.wait)  # raised once, by save() itself: not again
        disk.broken.clear()
        info = bounded(lambda: ckpt.save(state, step=1).wait())  # the slot and its ring are free again
        assert info.step == 1 and [i.step for i in ckpt.list()] == [1]
        assert ckpt.counters["host_bytes"] <= LIMIT
        assert_bit_equal(ref, ckpt.load(step=1))
        _no_files_of(tmp_path, "step-000000000")
    finally:
        ckpt.close(timeout=10)


def test_lazy_ring_write_failure_frees_the_step_prehook_and_raises_once(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])  # 4 weights of 256 KiB: lazy, in the ring
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 256)
    disk = BrokenDisk(open_storage(str(tmp_path)))
    ckpt = Checkpointer(_config(tmp_path, "lazy"), storage=disk)
    ckpt.watch(opt)

    def train_step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()  # the pre-hook waits until the pending snapshot is staged

    try:
        ckpt.save({"m": model.state_dict()}, step=0)
        bounded(train_step)  # used to wait forever: the copy thread waited for a ring buffer
        with pytest.raises(StorageError) as ei:
            bounded(ckpt.wait)
        assert "step-000000000" in str(ei.value) and isinstance(ei.value.__cause__, OSError)
        bounded(ckpt.wait)  # raised once
        disk.broken.clear()
        ref = clone_state({"m": model.state_dict()})
        h = bounded(lambda: ckpt.save({"m": model.state_dict()}, step=1))
        bounded(train_step)
        assert bounded(h.wait).step == 1
        assert ckpt.counters["host_bytes"] <= LIMIT
        assert_bit_equal(ref, ckpt.load(step=1))
        _no_files_of(tmp_path, "step-000000000")
    finally:
        ckpt.close(timeout=10)


def test_ring_write_failure_with_one_bad_write_raises_once(tmp_path) -> None:
    """Only the first write fails: the save is lost, the error named once, later saves are whole."""
    state = {f"t{i}": torch.randn(64, 1024) for i in range(6)}
    ref = clone_state(state)
    disk = BrokenDisk(open_storage(str(tmp_path)))
    calls = {"n": 0}
    inner_write = disk.write_file

    def first_only(path: str, parts: Sequence[memoryview]) -> None:
        calls["n"] += 1
        if calls["n"] > 1:
            disk.broken.clear()
        inner_write(path, parts)

    disk.write_file = first_only  # type: ignore[method-assign]
    ckpt = Checkpointer(_config(tmp_path, "eager"), storage=disk)
    try:
        try:
            h = bounded(lambda: ckpt.save(state, step=0))
        except StorageError:
            pass  # raised by save() itself (the copier saw the failure): the handle never existed
        else:
            with pytest.raises(StorageError):
                bounded(h.wait)
        bounded(ckpt.wait)  # once
        assert bounded(lambda: ckpt.save(state, step=1).wait()).step == 1
        assert_bit_equal(ref, ckpt.load(step=1))
        assert [i.step for i in ckpt.list()] == [1]
    finally:
        ckpt.close(timeout=10)
