"""Unchanged shards of a local root cloned by reflink (``persist.reflink``, storage/reflink.py, format/clonewrite.py):
on a real btrfs loop mount the frozen shard of a second save shares its extents with the first save's (FIEMAP
says so), loads bit-exact, and still does once the older checkpoint is deleted; on the normal tmp dir (ext4 here:
no reflinks) the probe says no and shards are written as before; the probe never follows a planted link."""
from __future__ import annotations

import array
import fcntl
import json
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import torch

import fastckpt.storage.reflink as reflink_mod
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.errors import ConfigError
from fastckpt.storage.reflink import probe_names, supports_reflink
from tests.helpers import assert_bit_equal

MiB = 1 << 20
_FS_IOC_FIEMAP = 0xC020660B
_FIEMAP_FLAG_SYNC = 0x1
_FIEMAP_EXTENT_SHARED = 0x2000
_EXTENT = struct.Struct("=QQQQQIIII")  # fe_logical, fe_physical, fe_length, 2 reserved, fe_flags, 3 reserved


def shared_bytes(path: Path) -> int:
    """Bytes of ``path`` in extents the file system reports shared with another file (FIEMAP)."""
    count = 512
    buf = array.array("B", struct.pack("=QQIIII", 0, 2**64 - 1, _FIEMAP_FLAG_SYNC, 0, count, 0)
                      + b"\0" * (_EXTENT.size * count))
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), _FS_IOC_FIEMAP, buf, True)
    mapped = struct.unpack_from("=QQIIII", buf)[3]
    assert mapped < count, "more extents than the test's buffer"
    total = 0
    for i in range(mapped):
        e = _EXTENT.unpack_from(buf, 32 + i * _EXTENT.size)
        if e[5] & _FIEMAP_EXTENT_SHARED:
            total += e[2]
    return total


@pytest.fixture(scope="module")
def btrfs(tmp_path_factory) -> Iterator[Path]:
    """A 1 GiB btrfs loop mount (needs root, mkfs.btrfs from btrfs-progs and loop devices)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a btrfs loop image needs root")
    if shutil.which("mkfs.btrfs") is None:
        pytest.skip("mkfs.btrfs missing (apt-get install -y btrfs-progs)")
    base = tmp_path_factory.mktemp("btrfs")
    img, mnt = base / "img", base / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(1024 * MiB)  # sparse: only what the tests write takes disk space
    made = subprocess.run(["mkfs.btrfs", "-q", str(img)], capture_output=True, text=True, timeout=60)
    if made.returncode != 0:
        pytest.skip(f"mkfs.btrfs failed: {made.stderr.strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True,
                             timeout=60)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a loop image here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=60)


FROZEN = 40 * MiB


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(7)
    frozen = torch.randn(FROZEN // 4, generator=g)  # the same every step: a frozen part of the model
    head = torch.full((64 * 1024,), float(step))  # changes every step
    return {"model": {"frozen": frozen, "head": head}, "step": step}


def _ck(root: Path, reflink: str = "auto") -> Checkpointer:
    return Checkpointer(CheckpointConfig(root=str(root), persist={"chunk_bytes": 1 * MiB, "reflink": reflink},
                                         staging={"mode": "eager"}))


def _two_saves(root: Path, reflink: str = "auto") -> tuple[Path, Path, int]:
    ck = _ck(root, reflink)
    try:
        ck.save(_state(1), step=1)
        ck.wait()
        ck.save(_state(2), step=2)
        ck.wait()
        cloned = ck._saver.dedup.cloned_bytes
    finally:
        ck.close()
    first, second = sorted(p.parent for p in root.glob("*/manifest.json"))
    return first, second, cloned


def _frozen_shard(folder: Path) -> Path:
    (big,) = [p for p in folder.glob("shard-*") if p.stat().st_size > FROZEN]
    return big


def test_frozen_shard_is_a_reflink_clone_and_survives_the_older_checkpoint(btrfs):
    root = btrfs / "clone"
    first, second, cloned = _two_saves(root)
    new = _frozen_shard(second)
    assert cloned == new.stat().st_size - 4096  # all but the header page was shared, not written
    assert shared_bytes(new) >= FROZEN  # the file system says its extents are shared
    small = [p for p in second.glob("shard-*") if p != new]
    assert small and all(shared_bytes(p) == 0 for p in small)  # the changed shards were written
    reader = _ck(root)
    try:
        assert_bit_equal(reader.load(step=2), _state(2))
        shutil.rmtree(first)  # the clone is an independent file
        os.sync()
        assert shared_bytes(new) == 0
        assert_bit_equal(reader.load(step=2), _state(2))
    finally:
        reader.close()


def _resumed_second_save(root: Path, between) -> int:
    """Step 1 by one Checkpointer, ``between(folder)``, then step 2 by a new one (a resumed run); bytes cloned."""
    ck = _ck(root)
    try:
        ck.save(_state(1), step=1)
        ck.wait()
    finally:
        ck.close()
    (first,) = [p.parent for p in root.glob("*/manifest.json")]
    between(first)
    ck = _ck(root)
    try:
        ck.save(_state(2), step=2)
        ck.wait()
        cloned = ck._saver.dedup.cloned_bytes
        assert_bit_equal(ck.load(step=2), _state(2))
    finally:
        ck.close()
    return cloned


def test_a_resumed_run_clones_from_the_newest_checkpoint(btrfs):
    assert _resumed_second_save(btrfs / "resumed", lambda first: None) >= FROZEN


def test_a_source_whose_listed_crc_disagrees_is_not_cloned(btrfs):
    """Records that match but a manifest CRC that does not: the records are not trusted, the shard is written."""
    def tamper(first: Path) -> None:
        mpath = first / "manifest.json"
        doc = json.loads(mpath.read_text())
        doc["files"][_frozen_shard(first).name]["crc32c"] ^= 1
        mpath.write_text(json.dumps(doc))
    assert _resumed_second_save(btrfs / "tampered", tamper) == 0


def test_a_source_replaced_by_a_symlink_is_not_followed(btrfs):
    victim = btrfs / "link-target"

    def plant(first: Path) -> None:
        shard = _frozen_shard(first)
        shutil.copyfile(shard, victim)
        shard.unlink()
        shard.symlink_to(victim)
    assert _resumed_second_save(btrfs / "linked", plant) == 0
    assert shared_bytes(victim) == 0


def test_a_checkpoint_of_only_frozen_shards_is_cloned_into_its_new_folder(btrfs):
    """The first shard of a save cloned: its folder does not exist yet (no shard of it was written)."""
    root = btrfs / "only-frozen"
    ck = _ck(root)
    try:
        for step in (1, 2):
            ck.save({"frozen": _state(step)["model"]["frozen"], "step": step}, step=step)
            ck.wait()
        assert ck._saver.dedup.cloned_bytes >= FROZEN
        assert_bit_equal(ck.load(step=2), {"frozen": _state(2)["model"]["frozen"], "step": 2})
    finally:
        ck.close()


def _one_shard_saves(root: Path, frozen_mib: int, head_mib: int) -> tuple[Path, Path, int]:
    """Two saves of one shard holding a frozen tensor and one that changes; returns both folders and bytes cloned."""
    g = torch.Generator().manual_seed(5)
    frozen = torch.randn(frozen_mib * MiB // 4, generator=g)
    ck = Checkpointer(CheckpointConfig(root=str(root), persist={"chunk_bytes": 256 * MiB},
                                       staging={"mode": "eager"}))
    try:
        for step in (1, 2):
            ck.save({"a_frozen": frozen, "b_head": torch.full((head_mib * MiB // 4,), float(step))}, step=step)
            ck.wait()
        cloned = ck._saver.dedup.cloned_bytes
    finally:
        ck.close()
    first, second = sorted(p.parent for p in root.glob("*/manifest.json"))
    return first, second, cloned


def test_a_shard_with_a_changed_tensor_clones_the_unchanged_ones(btrfs):
    """One shard, frozen 40 MiB + a changed 1 MiB tensor: the clone is patched with the header and the change."""
    root = btrfs / "patched"
    first, second, cloned = _one_shard_saves(root, 40, 1)
    (new,) = second.glob("shard-*")
    assert FROZEN - 4096 <= cloned <= FROZEN  # the changed tensor and the header were written, the rest shared
    assert shared_bytes(new) >= FROZEN - 8192  # whole blocks under the frozen tensor, edges written
    expect = {"a_frozen": torch.randn(FROZEN // 4, generator=torch.Generator().manual_seed(5)),
              "b_head": torch.full((MiB // 4,), 2.0)}
    reader = _ck(root)
    try:
        assert_bit_equal(reader.load(step=2), expect)
        shutil.rmtree(first)
        assert_bit_equal(reader.load(step=2), expect)
    finally:
        reader.close()


def test_a_mostly_changed_shard_is_written(btrfs):
    _, second, cloned = _one_shard_saves(btrfs / "mostly", 4, 20)
    (new,) = second.glob("shard-*")
    assert cloned == 0 and shared_bytes(new) == 0


def test_reflink_off_writes_every_shard(btrfs):
    root = btrfs / "off"
    _, second, cloned = _two_saves(root, reflink="off")
    assert cloned == 0 and shared_bytes(_frozen_shard(second)) == 0
    reader = _ck(root)
    try:
        assert_bit_equal(reader.load(step=2), _state(2))
    finally:
        reader.close()


def test_the_probe_says_no_on_the_tmp_dir_and_shards_are_written(tmp_path):
    fstype = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip()
    if fstype in ("btrfs", "xfs"):
        pytest.skip(f"the tmp dir is {fstype}, which may have reflinks: this test needs one without")
    assert supports_reflink(str(tmp_path)) is False
    assert not list(tmp_path.glob(".fastckpt-reflink-probe-*"))  # the probe cleaned up
    _, second, cloned = _two_saves(tmp_path)
    assert cloned == 0
    reader = _ck(tmp_path)
    try:
        assert_bit_equal(reader.load(step=2), _state(2))
    finally:
        reader.close()


def test_the_probe_never_follows_a_planted_link(btrfs, monkeypatch):
    root = btrfs / "planted"
    root.mkdir()
    victim = btrfs / "victim"
    victim.write_bytes(b"keep")
    a, _ = probe_names(str(root))
    os.symlink(victim, a)
    monkeypatch.setattr(reflink_mod, "_verdicts", {})  # probe this device afresh
    assert supports_reflink(str(root)) is False  # refused: the verdict is "no", files are written
    assert victim.read_bytes() == b"keep" and os.path.islink(a)  # not followed, and not ours to remove
    os.unlink(a)
    monkeypatch.setattr(reflink_mod, "_verdicts", {})
    assert supports_reflink(str(root)) is True
    assert not list(root.glob(".fastckpt-reflink-probe-*"))


def test_reflink_is_validated():
    with pytest.raises(ConfigError, match="persist.reflink"):
        CheckpointConfig(root="/tmp/x", persist={"reflink": "always"})
    assert CheckpointConfig(root="/tmp/x", persist={"reflink": False}).persist.reflink == "off"
