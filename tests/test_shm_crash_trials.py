"""SIGKILL trials for the shared-memory tier, alone and with 2 gloo ranks: every snapshot whose
``wait_staged()`` returned before the kill is committed by the next process(es) and loads bit for bit.

Each trial picks, from its seed, the step from which the disk hangs (or none: the kill then lands
in the middle of writes and commits), the step after whose ``wait_staged()`` the training process
is killed, and whether the root folder is emptied before the restart (then only the snapshots that
never committed must come back, from shared memory alone). Trial processes are forks of a
forkserver that has torch imported, so a trial costs a fraction of a second.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from fastckpt import Checkpointer
from tests import shm_children as kids

STEPS = 5


def _scenario(trial: int) -> tuple[int, int, bool]:
    rng = random.Random(trial)
    stuck_at = rng.randint(1, STEPS + 2)  # past STEPS the disk never hangs
    last = min(STEPS, stuck_at + 1)  # both slots fill behind a hung write, then save() blocks
    kill_after = rng.randint(1, last)
    empty_root = stuck_at <= kill_after and rng.random() < 0.3
    return stuck_at, kill_after, empty_root


def _crash(base: Path, trial: int, world: int) -> tuple[Path, Path, list[int], str]:
    """Run one trial's training on ``world`` ranks and SIGKILL them; return what must be committed."""
    root, shm = base / f"trial{trial}" / "ckpts", base / f"trial{trial}" / "shm"
    shm.mkdir(parents=True)
    stuck_at, kill_after, empty_root = _scenario(trial)
    what = (f"trial {trial}: disk hangs from step {stuck_at}, SIGKILL after step {kill_after}, "
            f"root emptied: {empty_root}")
    port = kids.free_port()
    ranks = [kids.start(kids.train, str(root), str(shm), STEPS, stuck_at, r, world, port) for r in range(world)]
    try:
        for proc, conn in ranks:
            assert [kids.receive(proc, conn) for _ in range(kill_after)] == list(range(1, kill_after + 1)), what
    finally:
        kids.kill(*(proc for proc, _ in ranks))
    if empty_root:
        shutil.rmtree(root, ignore_errors=True)  # only shared memory holds what never committed
    must = [s for s in range(1, kill_after + 1) if not empty_root or s >= stuck_at]
    return root, shm, must, what


def _recover_alone(root: Path, shm: Path, must: list[int], what: str) -> None:
    with Checkpointer(kids.config(str(root), str(shm))) as ck:
        try:
            kids.check_committed(ck, must)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from e


def _recover_ranks(root: Path, shm: Path, must: list[int], world: int = 2) -> list[tuple]:
    port = kids.free_port()
    ranks = [kids.start(kids.recover, str(root), str(shm), must, r, world, port) for r in range(world)]
    try:
        return [kids.receive(proc, conn) for proc, conn in ranks]
    finally:
        for proc, _ in ranks:
            proc.join(kids.REPLY_S)
        kids.kill(*(proc for proc, _ in ranks))


def _assert_clean(shm: Path, what: str) -> None:
    assert not any(shm.rglob("staged.json")) and not any(shm.rglob("*.bin")), f"{what}: shared memory left behind"


def _trials_alone(tmp_path: Path, trials: range) -> None:
    for trial in trials:
        root, shm, must, what = _crash(tmp_path, trial, world=1)
        _recover_alone(root, shm, must, what)
        _assert_clean(shm, what)


def _trials_ranks(tmp_path: Path, trials: range) -> None:
    for trial in trials:
        root, shm, must, what = _crash(tmp_path, trial, world=2)
        for rank, (status, *rest) in enumerate(_recover_ranks(root, shm, must)):
            assert status == "ok", f"{what}, rank {rank}: {rest[0]}"
        _assert_clean(shm, what)


def test_sigkill_trials_alone(tmp_path) -> None:
    _trials_alone(tmp_path, range(10))


def test_sigkill_trials_two_ranks(tmp_path) -> None:
    _trials_ranks(tmp_path, range(10))


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 50 trials: on a loaded 2-core host past the suite's 300 s
def test_sigkill_trials_alone_50(tmp_path) -> None:
    _trials_alone(tmp_path, range(100, 150))


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 50 trials: on a loaded 2-core host past the suite's 300 s
def test_sigkill_trials_two_ranks_50(tmp_path) -> None:
    _trials_ranks(tmp_path, range(100, 150))


def _staged_step2(tmp_path: Path, durable_first: bool = False) -> tuple[Path, Path]:
    """Two ranks staged step 2 (their disks hang), then both are SIGKILLed. ``durable_first``: step 1 is committed
    before step 2 is saved (else it may be on disk or only in shared memory when the kill comes)."""
    root, shm = tmp_path / "ckpts", tmp_path / "shm"
    shm.mkdir()
    port = kids.free_port()
    ranks = [kids.start(kids.train, str(root), str(shm), 2, 2, r, 2, port, durable_first) for r in range(2)]
    try:
        for proc, conn in ranks:
            assert [kids.receive(proc, conn) for _ in range(2)] == [1, 2]
    finally:
        kids.kill(*(proc for proc, _ in ranks))
    return root, shm


def _rank1_step2(shm: Path) -> Path:
    [record] = [r for r in shm.glob("*-rank1/*/*/staged.json") if json.loads(r.read_text())["step"] == 2]
    return record.parent


@pytest.mark.parametrize("damage", ["a flipped byte in rank 1's buffer", "rank 1's shared memory lost"])
def test_a_checkpoint_missing_a_verified_rank_part_is_discarded_on_every_rank(tmp_path, damage) -> None:
    root, shm = _staged_step2(tmp_path)
    slot = _rank1_step2(shm)
    if damage.startswith("a flipped"):
        buf = sorted(slot.glob("shard-*.bin"))[0]
        data = bytearray(buf.read_bytes())
        data[len(data) // 2] ^= 0x01
        buf.write_bytes(bytes(data))
    else:
        shutil.rmtree(slot)
    results = _recover_ranks(root, shm, must=[1])
    for rank, (status, *rest) in enumerate(results):
        assert status == "ok", f"rank {rank}: {rest[0]}"
        recovered, committed, warnings = rest
        assert 2 not in committed, f"rank {rank} committed step 2 although rank 1's part {damage}"
        assert committed == [1]
        assert any("NOT recovered" in w and "step 2" in w for w in warnings), (rank, warnings)
    _assert_clean(shm, damage)


def test_two_ranks_staged_snapshot_is_recovered_whole(tmp_path) -> None:
    root, shm = _staged_step2(tmp_path)
    results = _recover_ranks(root, shm, must=[1, 2])
    for rank, (status, *rest) in enumerate(results):
        assert status == "ok", f"rank {rank}: {rest[0]}"
        recovered, committed, _ = rest
        assert 2 in recovered and committed == [1, 2]
    _assert_clean(shm, "two ranks")


@pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user's namespace needs root (os.chown)")
def test_a_rank_whose_namespace_is_another_users_still_joins_the_agreement(tmp_path) -> None:
    """Rank 1's namespace refused (another uid's): it stages in host memory and recovers nothing, but still takes
    its part in the ranks' agreement, so rank 0 discards its half of step 2 instead of waiting for ever."""
    root, shm = _staged_step2(tmp_path, durable_first=True)  # step 1 on disk: only step 2 hangs on the agreement
    [theirs] = shm.glob("*-rank1")
    for path in [theirs, *theirs.rglob("*")]:
        os.lchown(path, 65534, 65534)
    results = _recover_ranks(root, shm, must=[1])
    for rank, (status, *rest) in enumerate(results):
        assert status == "ok", f"rank {rank}: {rest[0]}"
        recovered, committed, warnings = rest
        assert 2 not in recovered and committed == [1], (rank, recovered, committed)
        assert any("NOT recovered" in w and "step 2" in w for w in warnings), (rank, warnings)
    assert any("refusing to use this shared-memory folder" in w for w in results[1][3])
    assert any(theirs.rglob("staged.json")), "another user's files are left as they are"
