"""The shared-memory tier trusts only what this user made (issue 22, items 4 and 5).

The namespace's name is predictable and /dev/shm is writable by everyone: another uid can create the namespace
first, or plant a complete snapshot with valid checksums, a FIFO where a buffer or record should be, or a file
named like an owner folder. None of it may be recovered, loaded, followed, or hang or break a Checkpointer.
"Another uid" is simulated with ``os.chown`` to nobody (65534), which needs root; anything that could hang
runs in a child process under RLIMIT_AS and a timeout.
"""
from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer
from tests import shm_children as kids
from tests.helpers import assert_bit_equal, run_child
from tests.test_shm_load import CountingStorage, _committed_then_killed
from tests.test_shm_tier import _orphan, _records

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="simulating another user's files needs root (os.chown)")


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "shm").mkdir()
    return tmp_path / "ckpts", tmp_path / "shm"


def _chown_tree(path: Path, uid: int) -> None:
    os.lchown(path, uid, uid)
    for sub in path.rglob("*"):
        os.lchown(sub, uid, uid)


def _namespace(shm: Path) -> Path:
    [base] = [p for p in shm.iterdir() if p.name.startswith("fastckpt-")]
    return base


def _resume_and_save(root: Path, shm: Path) -> Checkpointer:
    """A Checkpointer on the root that must recover nothing, then still save and load bit for bit."""
    ck = Checkpointer(kids.config(str(root), str(shm)))
    assert ck.recovered == [], "a snapshot this user did not make was recovered"
    assert {c.step for c in ck.list()} <= {6}, ck.list()  # 6: this helper's own save, made again
    state = {"w": torch.arange(300, dtype=torch.float32), "step": 6}
    ck.save(state, step=6).wait()
    assert_bit_equal(state, ck.load())
    return ck


# ---- item 4: a snapshot is trusted only if this user made it --------------------------------------------------

@as_root
def test_a_namespace_made_by_another_uid_is_refused_and_staging_falls_back(dirs, caplog) -> None:
    root, shm = dirs
    dead = _orphan(root, shm)  # a complete snapshot, valid checksums, its owner dead
    base = _namespace(shm)
    _chown_tree(base, NOBODY)  # as if another user had created the (predictable) namespace and planted it
    os.chmod(base, 0o777)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with _resume_and_save(root, shm):
            pass
    assert f"{base}: refusing to use this shared-memory folder" in caplog.text
    assert f"owned by uid {NOBODY}" in caplog.text and "ordinary host memory" in caplog.text
    assert (dead / "staged.json").exists(), "another user's files are left as they are"
    assert [p.name for p in (root).iterdir() if p.name.startswith("step-")] == ["step-000000006"]


_FOREIGN = {
    "owner folder of another uid": lambda slot: _chown_tree(slot.parent, NOBODY),
    "slot folder of another uid": lambda slot: _chown_tree(slot, NOBODY),
    "record of another uid": lambda slot: os.chown(slot / "staged.json", NOBODY, NOBODY),
    "buffer of another uid": lambda slot: os.chown(sorted(slot.glob("shard-*.bin"))[0], NOBODY, NOBODY),
    "record writable by others": lambda slot: os.chmod(slot / "staged.json", 0o666),
    "slot folder writable by others": lambda slot: os.chmod(slot, 0o777),
}


@as_root
@pytest.mark.parametrize("plant", sorted(_FOREIGN))
def test_a_snapshot_planted_in_the_namespace_by_another_uid_is_never_recovered(dirs, caplog, plant) -> None:
    root, shm = dirs
    slot = _orphan(root, shm)
    _FOREIGN[plant](slot)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with _resume_and_save(root, shm):
            pass
    assert "not by this user" in caplog.text or "other users may write it" in caplog.text, caplog.text
    if "folder" in plant:  # skipped, warned of, and never deleted: not ours
        assert (slot / "staged.json").exists()


@as_root
def test_a_committed_snapshot_of_another_uid_is_not_loaded_from_shared_memory(dirs, caplog) -> None:
    root, shm = dirs
    _committed_then_killed(root, shm, steps=1)
    for owner in _namespace(shm).iterdir():
        if owner.is_dir():
            _chown_tree(owner, NOBODY)
    storage = CountingStorage(str(root))
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with Checkpointer(kids.config(str(root), str(shm)), storage=storage) as ck:
            assert_bit_equal(kids.expected(1), ck.load(step=1))
            assert ck.last_load_stats.tier == "local" and storage.shard_reads > 0
    assert f"owned by uid {NOBODY}" in caplog.text


def test_the_namespace_and_everything_in_it_is_this_users_alone(dirs) -> None:
    root, shm = dirs
    base = shm / "older"
    with Checkpointer(kids.config(str(root), str(shm))) as ck:
        base = _namespace(shm)
        ck.save({"w": torch.ones(64)}, step=1).wait()
        modes = {p.relative_to(base): stat.S_IMODE(p.lstat().st_mode) for p in [base, *base.rglob("*")]}
    assert modes[Path(".")] == 0o700, oct(modes[Path(".")])
    assert all(m & 0o077 == 0 for m in modes.values()), {str(p): oct(m) for p, m in modes.items()}
    os.chmod(base, 0o755)  # as an older fastckpt left it
    with Checkpointer(kids.config(str(root), str(shm))):
        assert stat.S_IMODE(base.stat().st_mode) == 0o700, "a namespace of this user's must be tightened to 0700"


def test_a_symlinked_namespace_is_never_followed(tmp_path, caplog) -> None:
    root, elsewhere, shm = tmp_path / "ckpts", tmp_path / "elsewhere", tmp_path / "shm"
    elsewhere.mkdir()
    shm.mkdir()
    dead = _orphan(root, elsewhere)  # a genuine snapshot, in another folder the link leads to
    base = _namespace(elsewhere)
    (shm / base.name).symlink_to(base)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with _resume_and_save(root, shm):
            pass
    assert "symbolic link" in caplog.text and str(shm / base.name) in caplog.text
    assert (dead / "staged.json").exists()


@pytest.mark.parametrize("mode, trusted", [(0o777, False), (0o1777, True)], ids=["world-writable", "sticky"])
def test_a_shm_dir_others_may_write_is_trusted_only_with_the_sticky_bit(dirs, caplog, mode, trusted) -> None:
    root, shm = dirs
    _orphan(root, shm)
    os.chmod(shm, mode)  # without the sticky bit another user could rename the namespace and put theirs there
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with Checkpointer(kids.config(str(root), str(shm))) as ck:
            assert [h.step for h in ck.recovered] == ([5] if trusted else [])
    assert ("without the sticky bit" in caplog.text) is not trusted


# ---- item 5: FIFOs, names of the wrong type, sizes bounded by entries ------------------------------------------

_LOAD_CHILD = """
import logging, sys
logging.basicConfig(level=logging.INFO)  # the fall-back from shared memory is said at INFO
from fastckpt import Checkpointer
from tests import shm_children as kids
from tests.helpers import assert_bit_equal, run_child
with Checkpointer(kids.config(sys.argv[1], sys.argv[2])) as ck:
    assert [h.step for h in ck.recovered] == [], ck.recovered
    assert_bit_equal(kids.expected(1), ck.load(step=1))
    print("served by", ck.last_load_stats.tier)
"""


def test_a_fifo_buffer_never_blocks_a_restarts_load(dirs) -> None:
    root, shm = dirs
    _committed_then_killed(root, shm, steps=1)
    buf = max(shm.rglob("shard-*.bin"), key=lambda p: p.stat().st_size)
    buf.unlink()
    os.mkfifo(buf, 0o600)  # opening it O_RDONLY blocks until a writer comes: none ever does
    done = run_child(_LOAD_CHILD, str(root), str(shm))
    assert done.returncode == 0, done.stderr
    assert "served by local" in done.stdout
    assert "FIFO" in done.stderr and buf.name in done.stderr  # said why shared memory was not used


def test_a_fifo_record_never_blocks_a_restart(dirs) -> None:
    root, shm = dirs
    _committed_then_killed(root, shm, steps=1)
    [record] = shm.rglob("committed.json")
    record.unlink()
    os.mkfifo(record.parent / "staged.json", 0o600)  # a staged record nobody will ever write
    done = run_child(_LOAD_CHILD, str(root), str(shm))
    assert done.returncode == 0, done.stderr
    assert "served by local" in done.stdout


@pytest.mark.parametrize("kind", ["file", "fifo", "symlink"])
def test_an_entry_named_like_an_owner_folder_is_skipped(dirs, caplog, kind) -> None:
    root, shm = dirs
    with Checkpointer(kids.config(str(root), str(shm))):
        base = _namespace(shm)
    fake = base / "4242-4242-0badf00d"
    if kind == "file":
        fake.write_bytes(b"not a folder")
    elif kind == "fifo":
        os.mkfifo(fake, 0o600)
    else:
        (shm.parent / "victim").mkdir()
        fake.symlink_to(shm.parent / "victim")
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        for _ in range(2):  # every construction, not only the first
            with _resume_and_save(root, shm):
                pass
    assert str(fake) in caplog.text
    assert os.path.lexists(fake), "an entry fastckpt did not make is left as it is"


def test_a_record_claiming_a_shard_larger_than_its_tensors_is_not_recovered(dirs, caplog) -> None:
    root, shm = dirs
    slot = _orphan(root, shm)
    doc = json.loads((slot / "staged.json").read_text())
    extra = 16 << 20  # recovery would write this many bytes that no tensor covers
    doc["shards"][0][1] += extra
    (slot / "staged.json").write_text(json.dumps(doc))
    buf = slot / "shard-00000.bin"
    os.truncate(buf, buf.stat().st_size + extra)  # sparse: the size check at open passes
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with _resume_and_save(root, shm):
            pass
    assert "'shards[0]' field is not sized by its tensors" in caplog.text and "NOT recovered" in caplog.text
    assert not _records(shm)
