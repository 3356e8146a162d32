"""The shared-memory tier: what a SIGKILLed process staged is persisted, bit for bit, by the next one;
what is damaged, planted or someone else's is never adopted."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, StorageError
from fastckpt.config import RemoteOptions
from fastckpt.storage.protocol import open_storage
from tests import shm_children as kids
from tests.helpers import GatedStorage, assert_bit_equal


def _crash(root: Path, shm: Path, steps: int, stuck_at: int) -> list[int]:
    """Train in a child whose disk hangs from ``stuck_at`` on; SIGKILL it once ``steps`` are staged."""
    proc, conn = kids.start(kids.train, str(root), str(shm), steps, stuck_at)
    try:
        reported = [kids.receive(proc, conn) for _ in range(steps)]
    finally:
        kids.kill(proc)
    assert reported == list(range(1, steps + 1))
    return reported


def _records(shm: Path) -> list[Path]:
    return sorted(shm.rglob("staged.json"))


def _staged_steps(shm: Path) -> set[int]:
    return {json.loads(r.read_text())["step"] for r in _records(shm)}


def _record_of(shm: Path, step: int) -> Path:
    [record] = [r for r in _records(shm) if json.loads(r.read_text())["step"] == step]
    return record


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "shm").mkdir()
    return tmp_path / "ckpts", tmp_path / "shm"


def test_every_staged_snapshot_is_recovered_before_the_constructor_returns(dirs) -> None:
    root, shm = dirs
    _crash(root, shm, steps=3, stuck_at=2)  # steps 2 and 3 staged in both slots, their writes hung
    assert {2, 3} <= _staged_steps(shm), "both staged snapshots must have their record before wait_staged() returns"
    with Checkpointer(CheckpointConfig(root=str(root))) as plain:
        assert plain.latest() in (None, 1)  # step 1's commit may still have been under way
    with Checkpointer(kids.config(str(root), str(shm))) as ck:
        assert ck.latest() == 3, "a resume right after the crash must start from the newest staged snapshot"
        assert [h.step for h in ck.recovered] in ([2, 3], [1, 2, 3])
        assert kids.check_committed(ck, [1, 2, 3]) == [1, 2, 3]
    assert not _records(shm) and not any(shm.rglob("*.bin")), "recovered snapshots must be cleaned up"


def test_snapshots_held_only_by_shared_memory_are_recovered(dirs) -> None:
    root, shm = dirs
    _crash(root, shm, steps=3, stuck_at=2)
    shutil.rmtree(root, ignore_errors=True)  # only shared memory holds steps 2 and 3 now
    with Checkpointer(kids.config(str(root), str(shm))) as ck:
        assert [h.step for h in ck.recovered] in ([2, 3], [1, 2, 3])
        assert kids.check_committed(ck, [2, 3])[-2:] == [2, 3]


def test_two_checkpointers_in_one_process_keep_their_own_records(dirs) -> None:
    root, shm = dirs
    proc, conn = kids.start(kids.two_in_one_process, str(root), str(shm))
    try:
        assert kids.receive(proc, conn) == "staged"
    finally:
        kids.kill(proc)
    for step in (1, 2):
        with Checkpointer(kids.config(str(root / f"run{step}"), str(shm))) as ck:
            assert [h.step for h in ck.recovered] == [step], "a Checkpointer adopted another root's record"
            kids.check_committed(ck, [step])  # each checkpoint holds its own save's bytes


def test_a_live_owner_is_never_adopted(dirs) -> None:
    root, shm = dirs
    proc, conn = kids.start(kids.train, str(root), str(shm), 2, 1)
    try:
        assert [kids.receive(proc, conn) for _ in range(2)] == [1, 2]
        with Checkpointer(kids.config(str(root), str(shm))) as other:  # same root, same machine, owner alive
            assert other.recovered == [] and other.latest() is None
            with pytest.raises(StorageError, match="lock|writer|pid"):  # one root, one writer (the root lock)
                other.save({"x": torch.ones(3)}, step=7, name="other")
        assert len(_records(shm)) == 2, "another Checkpointer must not touch a live owner's records"
    finally:
        kids.kill(proc)
    with Checkpointer(kids.config(str(root), str(shm))) as ck:
        assert [h.step for h in ck.recovered] == [1, 2]
        assert_bit_equal(kids.expected(2), ck.load(name="step-000000002"))


def test_a_recovered_snapshot_is_uploaded_once(dirs) -> None:
    root, shm = dirs
    _crash(root, shm, steps=3, stuck_at=2)
    remote = f"memory://fastckpt-shm-{uuid.uuid4().hex[:12]}"
    gated = GatedStorage(open_storage(remote))  # uploads wait until the constructor has returned
    cfg = dataclasses.replace(kids.config(str(root), str(shm)), remote=RemoteOptions(url=remote))
    with Checkpointer(cfg, remote_storage=gated) as ck:
        recovered, resumed = [h.step for h in ck.recovered], [h.step for h in ck.resumed_uploads]
        assert {2, 3} <= set(recovered) and sorted(recovered + resumed) == [1, 2, 3], (recovered, resumed)
        gated.gate.set()
        for h in ck.recovered + ck.resumed_uploads:
            h.wait_uploaded()
    with Checkpointer(CheckpointConfig(root=remote)) as far:
        assert kids.check_committed(far, [1, 2, 3]) == [1, 2, 3]


class _FailAfterGate(GatedStorage):
    """Writes wait for ``gate``, then fail: the process 'dies' with its snapshot staged and uncommitted."""

    def write_file(self, path, parts):
        self.gate.wait(timeout=60)
        raise OSError(5, "injected: the process died here", path)


def _orphan(root: Path, shm: Path, step: int = 5) -> Path:
    """A genuine staged slot, re-owned by a dead process that had this process's pid (pid reuse)."""
    storage = _FailAfterGate(open_storage(str(root)))
    ck = Checkpointer(kids.config(str(root), str(shm)), storage=storage)
    m, _ = kids.model()
    kids.set_step(m, step)
    ck.save(kids.state(m, step), step=step).wait_staged()
    [record] = _records(shm)
    dead = record.parent.parent.parent / f"{os.getpid()}-1-0badf00d" / "slot-1"
    shutil.copytree(record.parent, dead)
    doc = json.loads((dead / "staged.json").read_text())
    doc["owner"] = dead.parent.name
    (dead / "staged.json").write_text(json.dumps(doc))
    storage.gate.set()
    with pytest.raises(StorageError):
        ck.close()
    return dead


def test_a_dead_owner_whose_pid_was_reused_is_recovered(dirs) -> None:
    root, shm = dirs
    _orphan(root, shm)  # its pid is ours, its start time is not: a different, dead process
    with Checkpointer(kids.config(str(root), str(shm))) as ck:
        assert [h.step for h in ck.recovered] == [5]
        kids.check_committed(ck, [5])


def test_two_processes_starting_at_once_recover_a_snapshot_once(dirs) -> None:
    root, shm = dirs
    _orphan(root, shm)
    start = threading.Barrier(2)
    found: list[list[int]] = []

    def restart() -> None:
        start.wait()
        with Checkpointer(kids.config(str(root), str(shm))) as ck:
            found.append([h.step for h in ck.recovered])

    threads = [threading.Thread(target=restart, name=f"restart-{i}") for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(found) == [[], [5]], found
    with Checkpointer(kids.config(str(root), str(shm))) as ck:
        kids.check_committed(ck, [5])


def _tamper_bytes(slot: Path) -> None:
    buf = sorted(slot.glob("shard-*.bin"))[-1]
    data = bytearray(buf.read_bytes())
    data[len(data) // 2] ^= 0xFF
    buf.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip a byte", "remove a buffer", "truncate a buffer"])
def test_staged_bytes_that_do_not_verify_are_discarded_loudly(dirs, caplog, damage) -> None:
    root, shm = dirs
    _crash(root, shm, steps=2, stuck_at=2)
    record = _record_of(shm, 2)
    buf = sorted(record.parent.glob("shard-*.bin"))[0]
    if damage == "flip a byte":
        _tamper_bytes(record.parent)
    elif damage == "remove a buffer":
        buf.unlink()  # must never read as zeros
    else:
        os.truncate(buf, buf.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with Checkpointer(kids.config(str(root), str(shm))) as ck:
            assert [h.step for h in ck.recovered] in ([], [1])  # step 1 may still have been in flight
            assert kids.check_committed(ck, [1]) == [1], "the previous good checkpoint stays the latest"
    assert "NOT recovered" in caplog.text and str(record.parent) in caplog.text
    assert not (root / "step-000000002").exists()
    assert not _records(shm)


_PLANTS = {
    "dirpath outside the root": lambda doc, out: doc.update(dirpath=str(out / "x")),
    "name with ..": lambda doc, out: doc.update(name="../outside"),
    "uid with /../": lambda doc, out: doc.update(uid="ab/../../../outside"),
    "dtype that is not one": lambda doc, out: doc["entries"][0].__setitem__(0, "load"),
    "tensor past its shard": lambda doc, out: doc["entries"][0].__setitem__(5, 1 << 40),
    "another owner's record": lambda doc, out: doc.update(owner="1-1-00000000"),
    "step as text": lambda doc, out: doc.update(step="5"),
    "tree reference -1": lambda doc, out: doc.update(tree={"D": [["w", {"T": -1}]]}),
}


@pytest.mark.parametrize("plant", sorted(_PLANTS))
def test_planted_records_are_discarded_and_write_nothing_outside_the_root(tmp_path, caplog, plant) -> None:
    root, shm, out = tmp_path / "ckpts", tmp_path / "shm", tmp_path / "outside"
    shm.mkdir()
    dead = _orphan(root, shm)
    doc = json.loads((dead / "staged.json").read_text())
    _PLANTS[plant](doc, out)
    (dead / "staged.json").write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with Checkpointer(kids.config(str(root), str(shm))) as ck:
            assert ck.recovered == [] and ck.list() == []
    assert "NOT recovered" in caplog.text and str(dead / "staged.json") in caplog.text
    assert not out.exists() and not (tmp_path / "x").exists()
    assert {p.name for p in tmp_path.iterdir()} <= {"ckpts", "shm"}
    assert not _records(shm)


def test_a_symlinked_buffer_is_never_read(tmp_path, caplog) -> None:
    root, shm = tmp_path / "ckpts", tmp_path / "shm"
    shm.mkdir()
    dead = _orphan(root, shm)
    secret = tmp_path / "secret.bin"
    buf = sorted(dead.glob("shard-*.bin"))[0]
    secret.write_bytes(buf.read_bytes())  # same bytes: only the link itself gives it away
    buf.unlink()
    buf.symlink_to(secret)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with Checkpointer(kids.config(str(root), str(shm))) as ck:
            assert ck.recovered == []
    assert "NOT recovered" in caplog.text
    assert secret.exists()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    mnt = tmp_path / "tiny-shm"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True,
                       capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a 1 MiB tmpfs to fill (needs root and mount permission): {e}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_shm_raises_storage_error_instead_of_sigbus(tmp_path, tiny_tmpfs) -> None:
    proc, conn = kids.start(kids.fill_shm, str(tmp_path / "ckpts"), str(tiny_tmpfs))
    try:
        kind, message = kids.receive(proc, conn)
    finally:
        kids.kill(proc)
    assert kind == "StorageError", message
    assert "cannot reserve" in message and str(tiny_tmpfs) in message and "staging.shm: false" in message
    assert not any(tiny_tmpfs.rglob("*.bin")), "the partial reservation must be given back"


def test_a_full_shm_on_the_copy_thread_fails_that_save_once(tmp_path, tiny_tmpfs) -> None:
    """A watched state's buffers are made on the copy thread: on a full tmpfs save() returns, the next call raises the
    same StorageError once, the previous checkpoint is intact, and the failed slot's reservations are given back."""
    proc, conn = kids.start(kids.fill_shm_lazily, str(tmp_path / "ckpts"), str(tiny_tmpfs))
    try:
        kind, outcome = kids.receive(proc, conn)
    finally:
        kids.kill(proc)
    assert kind == "ok", outcome
    returned, failed, again, left = outcome
    assert returned == "returned"
    assert failed.startswith("StorageError: ") and "cannot reserve" in failed and str(tiny_tmpfs) in failed
    assert "staging.shm: false" in failed
    assert again == "wait ok", "raised once"
    # step 1's idle slot went when the new structure took a slot; the failed slot's reservations went at its failure
    assert left == [], f"the failed slot's buffers were left behind: {left}"


def test_shm_staging_cleans_up_after_itself(tmp_path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    cfg = CheckpointConfig(root=str(tmp_path / "c"), staging={"shm": True, "shm_dir": str(shm)})
    with Checkpointer(cfg) as ckpt:
        ckpt.save({"w": torch.ones(128)}, step=1).wait()
        assert not _records(shm)  # committed: nothing left to recover
        assert any(shm.rglob("shard-*.bin"))  # the buffers stay for reuse
        assert torch.equal(ckpt.load()["w"], torch.ones(128))
    assert not any(shm.rglob("*.bin")), "close() must release the shared memory"
    with Checkpointer(cfg) as again:
        assert again.recovered == []
