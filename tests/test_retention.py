"""Retention keeps the right checkpoints and never touches pending or newest ones."""
from __future__ import annotations

import os

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


_KILLED_IN_REMOVAL = """
import os, signal, sys
import torch
import fastckpt.storage.yieldremove as yr
from fastckpt import CheckpointConfig, Checkpointer

real, count = yr._remove, [0]
def dying(path, *args, **kwargs):  # the third entry retention removes: the process dies mid-removal
    count[0] += 1
    if count[0] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(path, *args, **kwargs)
ckpt = Checkpointer(CheckpointConfig(root=sys.argv[1], retention={"keep_last": 1}, persist={"fsync": False}))
ckpt.save({"w": torch.ones(4)}, 1).wait()
yr._remove = dying
ckpt.save({"w": torch.ones(4) * 2}, 2).wait()  # its commit's retention removes step 1
ckpt.close()
"""


def test_a_process_killed_while_retention_removes_a_folder_leaves_no_half_folder_under_its_name(tmp_path) -> None:
    """Retention takes an old folder from its name (one rename) before it removes its entries: a process killed in
    the middle leaves only a hidden folder (never listed, sorted oldest by stock Accelerate), not a checkpoint's name
    without its files, which stock readers would count or load; the next retention finishes the removal."""
    import subprocess
    import sys

    from fastckpt.format.manifest import MANIFEST
    from fastckpt.tiers.gc import REMOVING_PREFIX

    script = tmp_path / "child.py"
    script.write_text(_KILLED_IN_REMOVAL)
    root = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-3000:]
    visible = sorted(n for n in os.listdir(root) if not n.startswith("."))
    assert visible == ["step-000000002"], visible  # not step 1's name, half removed
    assert all((root / n / MANIFEST).exists() for n in visible)
    leftovers = [n for n in os.listdir(root) if n.startswith(REMOVING_PREFIX)]
    assert leftovers == [REMOVING_PREFIX + "step-000000001"], os.listdir(root)
    # the next writer's first write collects it as the dead save it is (its manifest went first; tiers/gc.py's proof)
    ckpt = Checkpointer(CheckpointConfig(root=str(root), retention={"keep_last": 1}, persist={"fsync": False},
                                         orphan_grace_s=0))
    try:
        assert [i.step for i in ckpt.list()] == [2]
        assert torch.equal(ckpt.load(2)["w"], torch.ones(4) * 2)
        ckpt.save({"w": torch.ones(4) * 3}, 3).wait()
    finally:
        ckpt.close()
    assert not any(n.startswith(REMOVING_PREFIX) for n in os.listdir(root)), os.listdir(root)  # collected
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["step-000000003"], os.listdir(root)


def test_a_planted_link_named_as_a_removal_leftover_is_never_followed_or_removed(tmp_path) -> None:
    """The collection of removal leftovers goes by gc's proof, never by the name: a symlink named like one, pointing
    at a folder that looks like a dead save (a real leftover's files), is left alone, and so is what it points to."""
    import shutil
    import subprocess
    import sys

    from fastckpt.tiers.gc import REMOVING_PREFIX

    script = tmp_path / "child.py"
    script.write_text(_KILLED_IN_REMOVAL)
    root = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-3000:]
    outside = tmp_path / "users-folder"
    shutil.move(str(root / (REMOVING_PREFIX + "step-000000001")), outside)  # a dead save's files, elsewhere
    kept = sorted(os.listdir(outside))
    link = root / (REMOVING_PREFIX + "planted")
    link.symlink_to(outside, target_is_directory=True)
    ckpt = Checkpointer(CheckpointConfig(root=str(root), retention={"keep_last": 1}, persist={"fsync": False},
                                         orphan_grace_s=0))
    try:
        ckpt.save({"w": torch.ones(4) * 3}, 3).wait()  # the first write collects; retention removes step 2
    finally:
        ckpt.close()
    assert link.is_symlink() and sorted(os.listdir(outside)) == kept and kept
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["step-000000003"]


def test_a_name_too_long_for_the_hidden_prefix_is_removed_in_place(tmp_path) -> None:
    """A checkpoint name of 250 bytes leaves no room for the removal's hidden prefix (the rename fails with
    ENAMETOOLONG): retention removes it in place, as before, instead of failing."""
    ckpt = Checkpointer(CheckpointConfig(root=str(tmp_path), retention={"keep_last": 1}, persist={"fsync": False}))
    try:
        ckpt.save({"w": torch.ones(4)}, 1, name="a" * 250).wait()
        ckpt.save({"w": torch.ones(4) * 2}, 2).wait()
    finally:
        ckpt.close()
    assert sorted(n for n in os.listdir(tmp_path) if not n.startswith(".")) == ["step-000000002"]
