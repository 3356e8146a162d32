"""Loading from the shared-memory tier (issue 13): after a crash, a restarted process on the same machine
loads the committed checkpoint out of the snapshot still staged in /dev/shm, verified, without reading its
shards from disk; the nearest tier that holds the committed step serves the load."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.storage.local import LocalStorage
from tests import shm_children as kids
from tests.helpers import assert_bit_equal


class CountingStorage(LocalStorage):
    """Local storage that counts the reads of shard files (mapped or read)."""

    def __init__(self, root: str) -> None:
        super().__init__(root, fsync=False)
        self.shard_reads = 0

    def map_file(self, path: str, size: int, readahead: bool = True) -> Any:
        self.shard_reads += path.endswith(".safetensors")
        return super().map_file(path, size, readahead)

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.shard_reads += path.endswith(".safetensors")
        super().read_into(path, offset, out)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "shm").mkdir()
    return tmp_path / "ckpts", tmp_path / "shm"


def _committed_then_killed(root: Path, shm: Path, steps: int) -> None:
    proc, conn = kids.start(kids.save_committed, str(root), str(shm), steps)
    try:
        assert [kids.receive(proc, conn) for _ in range(steps)] == list(range(1, steps + 1))
    finally:
        kids.kill(proc)


def test_a_restart_loads_the_committed_step_from_shared_memory(dirs) -> None:
    root, shm = dirs
    _committed_then_killed(root, shm, steps=2)  # step 2 reused step 1's free slot: only step 2 is in memory
    storage = CountingStorage(str(root))
    with Checkpointer(kids.config(str(root), str(shm)), storage=storage) as ck:
        assert ck.recovered == []  # committed already: nothing to persist again
        assert_bit_equal(kids.expected(2), ck.load())
        stats = ck.last_load_stats
        assert (stats.tier, stats.method, stats.step, stats.verified) == ("shm", "shm", 2, True)
        assert stats.nbytes == sum(t.numel() * t.element_size() for t in kids.expected(2)["model"].values()) + 1200
        assert storage.shard_reads == 0, "the shards were read from disk although shared memory held them"
        assert_bit_equal(kids.expected(1), ck.load(step=1))  # not in memory any more: the next tier serves it
        assert ck.last_load_stats.tier == "local" and storage.shard_reads > 0
        m, _ = kids.model()
        kids.set_step(m, 0)
        ck.load_into({"model": m.state_dict(), "eager": torch.zeros(300), "step": 0, "tag": ""}, step=2)
        assert_bit_equal(kids.expected(2)["model"], m.state_dict())
        assert ck.last_load_stats.tier == "shm"
    assert not any(shm.rglob("*.bin")), "close() must give the dead process's shared memory back"


def test_a_snapshot_recovered_at_startup_is_then_loaded_from_shared_memory(dirs) -> None:
    root, shm = dirs
    proc, conn = kids.start(kids.train, str(root), str(shm), 3, 2)  # steps 2 and 3 staged, their writes hung
    try:
        assert [kids.receive(proc, conn) for _ in range(3)] == [1, 2, 3]
    finally:
        kids.kill(proc)
    storage = CountingStorage(str(root))
    with Checkpointer(kids.config(str(root), str(shm)), storage=storage) as ck:
        assert ck.latest() == 3
        assert_bit_equal(kids.expected(3), ck.load())
        assert ck.last_load_stats.tier == "shm" and storage.shard_reads == 0


def test_an_altered_shared_memory_snapshot_falls_back_to_the_local_copy(dirs, caplog) -> None:
    root, shm = dirs
    _committed_then_killed(root, shm, steps=1)
    buf = sorted(p for p in shm.rglob("shard-*.bin") if p.stat().st_size > 1000)[0]
    data = bytearray(buf.read_bytes())
    data[100] ^= 0xFF
    buf.write_bytes(bytes(data))
    storage = CountingStorage(str(root))
    with Checkpointer(kids.config(str(root), str(shm)), storage=storage) as ck:
        with caplog.at_level(logging.WARNING, logger="fastckpt"):
            assert_bit_equal(kids.expected(1), ck.load(step=1))
        assert ck.last_load_stats.tier == "local" and storage.shard_reads > 0
    assert any("shared memory failed" in r.getMessage() and "checksum mismatch" in r.getMessage()
               for r in caplog.records)


def test_a_snapshot_of_another_save_of_the_same_name_is_not_used(dirs) -> None:
    """The name and step match but the root's checkpoint was saved again since (another uid): the disk wins."""
    root, shm = dirs
    _committed_then_killed(root, shm, steps=1)
    m, _ = kids.model()
    kids.set_step(m, 7)
    with Checkpointer(CheckpointConfig(root=str(root))) as plain:  # re-save step 1's name with other values
        plain.save(kids.state(m, 1), step=1).wait()
    with Checkpointer(kids.config(str(root), str(shm))) as ck:
        got = ck.load(step=1)
        assert ck.last_load_stats.tier == "local"
    assert torch.equal(got["model"]["0.weight"], m.state_dict()["0.weight"])


def _open_fds() -> int:
    return len(list(Path("/proc/self/fd").iterdir()))


def test_a_buffer_cut_short_while_it_is_read_falls_back_and_leaks_no_descriptor(dirs, caplog, monkeypatch) -> None:
    from fastckpt.tiers.shm import ShmTier

    root, shm = dirs
    _committed_then_killed(root, shm, steps=1)
    opened = ShmTier.buffer_files

    def then_cut(self, rec):  # another process shrinks a buffer after the checks at open
        fds = opened(self, rec)
        fd = max(fds.values(), key=lambda f: os.fstat(f).st_size)
        os.truncate(os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size // 2)  # by name, as another would
        return fds

    monkeypatch.setattr(ShmTier, "buffer_files", then_cut)
    storage = CountingStorage(str(root))
    with Checkpointer(kids.config(str(root), str(shm)), storage=storage) as ck:
        before = _open_fds()
        with caplog.at_level(logging.WARNING, logger="fastckpt"):
            assert_bit_equal(kids.expected(1), ck.load(step=1))
        assert ck.last_load_stats.tier == "local" and storage.shard_reads > 0
        assert _open_fds() == before  # the buffers' descriptors are closed on the failure path too
    assert any("shared memory failed" in r.getMessage() and "ended early" in r.getMessage() for r in caplog.records)


def test_a_symlinked_buffer_of_a_committed_snapshot_is_not_read(dirs, caplog) -> None:
    root, shm = dirs
    _committed_then_killed(root, shm, steps=1)
    buf = sorted(p for p in shm.rglob("shard-*.bin") if p.stat().st_size > 1000)[0]
    elsewhere = root.parent / "elsewhere.bin"
    elsewhere.write_bytes(buf.read_bytes())  # the same bytes: only the link gives it away
    buf.unlink()
    buf.symlink_to(elsewhere)
    storage = CountingStorage(str(root))
    with Checkpointer(kids.config(str(root), str(shm)), storage=storage) as ck:
        with caplog.at_level(logging.INFO, logger="fastckpt"):
            assert_bit_equal(kids.expected(1), ck.load(step=1))
        assert ck.last_load_stats.tier == "local" and storage.shard_reads > 0
    assert any("cannot use the snapshot" in r.getMessage() and buf.name in r.getMessage() for r in caplog.records)
