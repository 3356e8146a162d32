"""User files are sacred (issue 22, items 1-3): `fastckpt gc`, the automatic sweeps and every file fastckpt creates
never delete, overwrite or follow what fastckpt did not write; `list` and `gc` read a Lightning dirpath that holds
sharded `*.ckpt` folders. Dead saves are made for real: child processes SIGKILLed inside fastckpt's own code."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, LocalStorage
from fastckpt.cli import main
from fastckpt.errors import StorageError
from helpers import assert_bit_equal

REPO = Path(__file__).resolve().parents[1]
DAY = 24 * 3600


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(8, 8, generator=g)}, "global_step": step, "epoch": 0}


def _snapshot(*roots: Path) -> dict[str, tuple]:
    """Every entry under ``roots`` (never followed): its kind, link target or content digest."""
    out: dict[str, tuple] = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                p = Path(dirpath) / name
                st = p.lstat()
                if stat.S_ISLNK(st.st_mode):
                    out[str(p)] = ("link", os.readlink(p))
                elif stat.S_ISREG(st.st_mode):
                    out[str(p)] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
                else:
                    out[str(p)] = ("dir" if stat.S_ISDIR(st.st_mode) else "other",)
    return out


def _age(root: Path, seconds: float) -> None:
    """Age every entry under ``root`` (links themselves, not their targets) by ``seconds``: no sleeps."""
    t = os.path.getmtime(root) - seconds
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            os.utime(Path(dirpath) / name, (t, t), follow_symlinks=False)


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The command in a child: a FIFO that it wrongly opened would hang it, and the timeout ends it."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "fastckpt", *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def _user_files(d: Path, outside: Path) -> None:
    """Twenty kinds of files and folders a user may keep next to checkpoints, none of them written by fastckpt."""
    outside.mkdir()
    (outside / "precious.txt").write_text("the user's only copy")
    (outside / "shard-00000.0123456789ab.safetensors").write_bytes(b"\0" * 64)
    torch.save({"w": torch.ones(3)}, outside / "elsewhere.ckpt")
    torch.save({"w": torch.ones(2)}, d / "legacy.ckpt", _use_new_zipfile_serialization=False)  # 1 legacy format
    torch.save(torch.nn.Linear(2, 2), d / "whole_module.pt")  # 2 weights_only refuses it
    (d / "unrelated.bin").write_bytes(os.urandom(300))  # 3
    (d / "truncated.pth").write_bytes((d / "whole_module.pt").read_bytes()[:200])  # 4 a torn zip of the user's
    torch.save({"w": torch.zeros(2)}, d / "weights.pt")  # 5 a plain state dict, no step
    (d / "link_out.ckpt").symlink_to(outside / "elsewhere.ckpt")  # 6 a symlink out
    (d / "dangling.ckpt").symlink_to(outside / "missing.ckpt")  # 7
    (d / "step-000000001").symlink_to(outside)  # 8 a symlinked folder named like a save
    (d / "step-000000002").mkdir()  # 9 a folder named like a save, with the user's notes
    (d / "step-000000002" / "notes.txt").write_text("mine")
    fake = d / "step-000000003"  # 10 named like a save's files, written by the user
    fake.mkdir()
    (fake / "shard-00000.0123456789ab.safetensors").write_bytes(os.urandom(128))
    (fake / "meta.0123456789ab.json").write_text(json.dumps({"tree": 1, "tensors": []}))
    (d / ".last.ckpt.fastckpt-tmp-4242-777").write_bytes(b"\0" * 100)  # 11 named like a temporary file
    (d / ".x.ckpt.fastckpt-tmp-abcd").write_bytes(b"x")  # 12 ... with a marker that is not fastckpt's
    (d / ".x.ckpt.fastckpt-tmp-abcd.fastckpt-mark").write_text("hello")
    (d / ".y.ckpt.fastckpt-tmp-beef").symlink_to(outside / "precious.txt")  # 13 a temp-named link, right marker
    from fastckpt.storage.tempmark import mark_bytes

    (d / ".y.ckpt.fastckpt-tmp-beef.fastckpt-mark").write_bytes(mark_bytes(".y.ckpt.fastckpt-tmp-beef"))
    os.mkfifo(d / "pipe.ckpt")  # 14 a FIFO: opening it for reading would block
    (d / "notes.ckpt").mkdir()  # 15 a folder named like a checkpoint file
    (d / "notes.ckpt" / "readme.md").write_text("not a checkpoint")
    (d / "step-000000004").mkdir()  # 16 only a file named like a manifest being committed
    (d / "step-000000004" / "manifest.json.tmp-1-2").write_text("{}")
    (d / ".hidden.pt").write_bytes(b"hidden")  # 17
    (d / "empty.ckpt").write_bytes(b"")  # 18
    (d / "model.safetensors").write_bytes(b"\x02\0\0\0\0\0\0\0{}")  # 19
    (d / "checkpoint.pth").write_text("not a checkpoint")  # 20
    (d / "step-000000005").symlink_to(outside / "shard-00000.0123456789ab.safetensors")  # 21 link to a file


_KILLED_SAVES = r'''
import os, signal, sys, torch
from fastckpt import CheckpointConfig, Checkpointer, LocalStorage
import fastckpt.storage.local as local

d = sys.argv[1]
# Where the file system has O_TMPFILE, a new file is written unnamed and linked in once complete: no temporary
# name exists to leave behind. Named temporary files (and their markers) are what a file system without it gets.
local._UNNAMED_OK = False
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "before-rename":  # a single-file save killed right before its rename: temp + marker left
    local.os.replace = die
    LocalStorage(d).write_file_atomic(os.path.join(d, "epoch=0-step=7.ckpt"), [memoryview(b"PK\3\4" + bytes(500))])
elif sys.argv[2] == "before-unmark":  # killed between the rename and the marker's removal: a lone marker left
    LocalStorage.unmark_temp = die
    LocalStorage(d).write_file_atomic(os.path.join(d, "epoch=0-step=8.ckpt"), [memoryview(b"PK\3\4" + bytes(50))])
else:  # a core save killed right before its commit: shards and meta, no manifest
    LocalStorage.write_atomic = die
    with Checkpointer(CheckpointConfig(root=d)) as ckpt:  # its first write sweeps the root: nothing of the user's
        ckpt.save({"w": torch.ones(4, 4)}, step=9).wait()
'''


def _kill_inside(d: Path, how: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", _KILLED_SAVES, str(d), how], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == -9, proc.stderr


def test_gc_removes_nothing_of_twenty_kinds_of_user_files_and_exactly_its_own_garbage(tmp_path) -> None:
    d, outside = tmp_path / "dirpath", tmp_path / "outside"
    d.mkdir()
    _user_files(d, outside)
    torch.save(_state(6), d / "epoch=0-step=6.ckpt")  # a checkpoint: what makes this a Lightning dirpath
    _age(d, DAY)
    _age(outside, DAY)
    before = _snapshot(d, outside)

    listed = _cli("list", str(d), "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {r["name"]: r for r in json.loads(listed.stdout)}
    assert rows["whole_module.pt"]["status"] == "foreign" and rows["unrelated.bin"]["status"] == "foreign"
    assert rows["truncated.pth"]["status"] == "torn" and "pipe.ckpt" not in rows and "notes.ckpt" not in rows
    for argv in (["--dry-run"], ["--keep-last", "1", "--dry-run"], []):
        run = _cli("gc", str(d), *argv)
        assert run.returncode == 0 and run.stdout == "", (argv, run.stdout, run.stderr)
        assert f"nothing to remove under {d}" in run.stderr
        if "--dry-run" in argv:  # changes nothing, not even the lock
            assert _snapshot(d, outside) == before
        else:  # the real one holds the root's lock, as a writer does
            lock = str(d / ".fastckpt.lock")
            assert _snapshot(d, outside) == {**before, lock: _snapshot(d)[lock]}

    # fastckpt's own garbage, made by its own code killed at the worst moments (the core save's first write also
    # runs the automatic sweep over all of the above: it removes nothing either)
    for how in ("before-rename", "before-unmark", "core-save"):
        _kill_inside(d, how)
    ours = set(_snapshot(d)) - set(before) - {str(d / ".fastckpt.lock")}
    temp = [p for p in ours if ".epoch=0-step=7.ckpt.fastckpt-tmp-" in p]
    assert len(temp) == 2 and any(p.endswith(".fastckpt-mark") for p in temp)  # the temp file and its marker
    lone = [p for p in ours if "step=8" in p and p.endswith(".fastckpt-mark")]
    renamed = str(d / "epoch=0-step=8.ckpt")  # the file that save renamed into place: a checkpoint, kept
    assert len(lone) == 1 and renamed in ours
    dead = d / "step-000000009"
    assert {str(dead)} | {str(dead / n) for n in os.listdir(dead)} <= ours and "manifest.json" not in os.listdir(dead)
    assert {p for p in before if p not in _snapshot(d, outside)} == set()
    _age(d, DAY)
    run = _cli("gc", str(d), "--dry-run")
    assert run.returncode == 0 and run.stdout.count("would remove") == 4 and _snapshot(d, outside).keys() >= ours
    run = _cli("gc", str(d))
    assert run.returncode == 0, run.stderr
    removed = {line.split()[1] for line in run.stdout.splitlines()}
    assert removed == {str(dead), *temp, *lone}
    after = _snapshot(d, outside)
    assert ours & set(after) == {renamed}
    assert {k: v for k, v in after.items() if k not in (str(d / ".fastckpt.lock"), renamed)} == \
        {k: v for k, v in before.items() if k != str(d / ".fastckpt.lock")}


def test_gc_never_removes_through_a_symlinked_checkpoint_and_reports_only_what_it_removed(tmp_path) -> None:
    root = tmp_path / "root"
    outside = root / "archive"  # the user's archive of another run, inside the root (a link out is ignored)
    with Checkpointer(CheckpointConfig(root=str(outside))) as ckpt:
        ckpt.save(_state(1), step=1).wait()
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
        ckpt.save(_state(2), step=2).wait()
        ckpt.save(_state(3), step=3).wait()
    (root / "step-000000001").symlink_to(outside / "step-000000001")  # the user's link to another run's step 1
    (outside / ".fastckpt.lock").unlink()
    before = _snapshot(outside)
    run = _cli("gc", str(root), "--keep-last", "1")
    assert run.returncode == 1
    assert run.stdout.split() == ["removed", str(root / "step-000000002"), "(step", "2,", "retention)"]
    assert str(root / "step-000000001") in run.stderr and "symlink" in run.stderr
    assert _snapshot(outside) == before and os.path.islink(root / "step-000000001")
    with Checkpointer(CheckpointConfig(root=str(outside))) as ckpt:
        assert_bit_equal(ckpt.load(step=1), _state(1))


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo"])
def test_a_planted_lock_file_is_refused_and_what_it_names_is_untouched(tmp_path, plant) -> None:
    root, victim = tmp_path / "root", tmp_path / "victim.txt"
    root.mkdir()
    victim.write_text("the user's file")
    lock = root / ".fastckpt.lock"
    {"symlink": lambda: lock.symlink_to(victim), "hardlink": lambda: os.link(victim, lock),
     "fifo": lambda: os.mkfifo(lock)}[plant]()
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
        with pytest.raises(StorageError, match=r"\.fastckpt\.lock"):
            ckpt.save(_state(1), step=1).wait()
    assert victim.read_text() == "the user's file"
    run = _cli("gc", str(root), timeout=60)
    assert run.returncode == 1 and ".fastckpt.lock" in run.stderr and victim.read_text() == "the user's file"


def test_files_fastckpt_writes_are_created_anew_never_through_a_planted_link(tmp_path) -> None:
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    storage = LocalStorage(str(tmp_path / "root"))
    os.makedirs(storage.url)
    shard = os.path.join(storage.url, "shard-00000.0123456789ab.safetensors")
    os.symlink(victim, shard)  # a link planted under the name of a file fastckpt is about to write
    storage.write_file(shard, [memoryview(b"new bytes")])
    assert victim.read_bytes() == b"precious" and not os.path.islink(shard) and Path(shard).read_bytes() == b"new bytes"
    shared = os.path.join(storage.url, ".a.ckpt.fastckpt-tmp-0123456789ab")
    os.symlink(victim, shared)
    with pytest.raises(StorageError, match="fastckpt-tmp"):
        storage.write_at(shared, [(0, memoryview(b"XX"))])
    with pytest.raises(StorageError):
        storage.mark_temp(shared, create_temp=True)  # rank 0 of a shared file creates it: O_EXCL refuses the link
    assert victim.read_bytes() == b"precious"
    storage.write_file_atomic(os.path.join(storage.url, "b.ckpt"), [memoryview(b"whole")])
    assert sorted(os.listdir(storage.url)) == sorted(["shard-00000.0123456789ab.safetensors", os.path.basename(shared),
                                                      "b.ckpt"])  # no temporary file, no marker left


def _sharded_dirpath(d: Path) -> None:
    """A Lightning dirpath: a file checkpoint, FastModelParallelStrategy's sharded folders (core checkpoints under
    Lightning's names), and stock Lightning's sharded (DCP) folder."""
    d.mkdir()
    torch.save(_state(2), d / "epoch=0-step=2.ckpt")
    with Checkpointer(CheckpointConfig(root=str(d))) as ckpt:
        for step in (4, 6):
            ckpt.save(_state(step), step=step, name=f"epoch=0-step={step}.ckpt").wait()
    dcp = d / "epoch=0-step=8.ckpt"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"\0")
    (dcp / "__0_0.distcp").write_bytes(b"\0" * 10)


def test_list_and_gc_read_a_dirpath_holding_sharded_ckpt_folders(tmp_path, capsys) -> None:
    d = tmp_path / "dirpath"
    _sharded_dirpath(d)
    assert main(["list", str(d), "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert {n: (r["step"], r["status"], r["layout"]) for n, r in rows.items()} == {
        "epoch=0-step=2.ckpt": (2, "committed", "lightning"),
        "epoch=0-step=4.ckpt": (4, "committed", "lightning-sharded"),
        "epoch=0-step=6.ckpt": (6, "committed", "lightning-sharded"),
        "epoch=0-step=8.ckpt": (8, "committed", "lightning-dcp")}
    assert main(["gc", str(d), "--keep-last", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("removed") == 2 and "epoch=0-step=2.ckpt  (step 2" in out and "epoch=0-step=4.ckpt  (step 4" in out
    assert sorted(os.listdir(d)) == [".fastckpt.lock", "epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]
    with Checkpointer(CheckpointConfig(root=str(d))) as ckpt:
        assert_bit_equal(ckpt.load(name="epoch=0-step=6.ckpt"), _state(6))
    assert os.listdir(d / "epoch=0-step=8.ckpt")  # stock Lightning's folder is not fastckpt's to remove
