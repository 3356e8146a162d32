"""Hostile checkpoints: planted names, symlinks, crafted tensor tables and manifests, pickled payloads.

Every name read from disk is checked (fastckpt/format/paths.py), every table row is bounds-checked before
anything is allocated (fastckpt/format/table.py), and one bad entry never stops a resume from the root.
Crafted files keep valid checksums (the manifest is rewritten to match) so that only the bounds
checks can catch them: ``verify_on_load`` off must refuse them too.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, load_checkpoint
from fastckpt.format.checksum import crc32c
from fastckpt.cli import main
from fastckpt.errors import IntegrityError, StorageError, UnsafeCheckpointError
from fastckpt.storage.local import LocalStorage
from fastckpt.storage.protocol import open_storage
from tests.helpers import assert_bit_equal

STEP_NAME = "step-000000001"


def _state() -> dict:
    return {"a": torch.arange(16, dtype=torch.float32), "b": torch.full((4, 4), 2.5, dtype=torch.bfloat16),
            "n": 3, "tag": ["x", 1]}


def _save(root: Path, step: int = 1, **cfg: Any) -> Path:
    with Checkpointer(CheckpointConfig(root=str(root), **cfg)) as ckpt:
        ckpt.save(_state(), step=step).wait()
    return root / f"step-{step:09d}"


class Ckpt:
    """A committed checkpoint directory whose files a test rewrites, keeping the manifest's checksums valid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.manifest = json.loads((path / "manifest.json").read_bytes())
        self.meta_name = self.manifest["meta"]
        self.meta = json.loads((path / self.meta_name).read_bytes())
        self.shard = self.meta["tensors"][0]["file"]

    def write_file(self, name: str, data: bytes) -> None:
        """Replace (or add) a listed file and re-checksum it in the manifest."""
        (self.path / name).write_bytes(data)
        self.manifest["files"][name] = {"size": len(data), "crc32c": crc32c(data)}

    def commit(self, meta: bytes | None = None, manifest: bytes | None = None) -> None:
        """Write the meta file (re-checksummed), then the manifest: as crafted, or the current dict."""
        self.write_file(self.meta_name, meta if meta is not None else json.dumps(self.meta).encode())
        self.write_manifest(manifest)

    def write_manifest(self, raw: bytes | None = None) -> None:
        (self.path / "manifest.json").write_bytes(raw if raw is not None else json.dumps(self.manifest).encode())

    def row(self, key: str) -> dict:
        return next(t for t in self.meta["tensors"] if t["key"] == key)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _tree_nested(depth: int) -> bytes:
    return b'{"L": [' * depth + b"1" + b"]}" * depth


def _set(path: str, value: Any) -> Callable[[Ckpt], None]:
    """A crafted case: set ``manifest.<field>`` / ``meta.<field>`` / ``row.<key>.<field>`` to ``value``."""
    where, *rest = path.split(".")

    def craft(c: Ckpt) -> None:
        if where == "manifest":
            c.commit()
            c.manifest[rest[0]] = value
            c.write_manifest()
            return
        if where == "meta":
            c.meta[rest[0]] = value
        else:
            c.row(rest[0])[rest[1]] = value
        c.commit()
    return craft


def _file_record(c: Ckpt, field: str, value: Any) -> None:
    c.commit()
    c.manifest["files"][c.shard][field] = value
    c.write_manifest()


def _rename_listed(c: Ckpt, new: str) -> None:
    c.commit()
    c.manifest["files"][new] = c.manifest["files"].pop(c.shard)
    c.write_manifest()


def _raw_manifest(data: bytes) -> Callable[[Ckpt], None]:
    return lambda c: c.commit(manifest=data)


def _raw_meta(data: bytes) -> Callable[[Ckpt], None]:
    return lambda c: c.commit(meta=data)


def _shard_header(length: int) -> Callable[[Ckpt], None]:
    def craft(c: Ckpt) -> None:
        data = bytearray((c.path / c.shard).read_bytes())
        data[:8] = struct.pack("<Q", length)
        c.write_file(c.shard, bytes(data))
        c.commit()
    return craft


def _overlap(c: Ckpt) -> None:
    a, b = c.row("a"), c.row("b")
    b["offset"] = a["offset"] + 8  # inside a's bytes, still within the file
    c.commit()


def _past_end(c: Ckpt) -> None:
    c.row("a")["offset"] = c.manifest["files"][c.shard]["size"] - 8  # starts inside, ends past the end
    c.commit()


def _truncated_shard(c: Ckpt) -> None:
    c.write_file(c.shard, (c.path / c.shard).read_bytes()[:4])
    c.commit()


CRAFTED: dict[str, Callable[[Ckpt], None]] = {
    # manifests
    "manifest-not-json": _raw_manifest(b"\x00\x01garbage"),
    "manifest-not-utf8": _raw_manifest(b'{"format": "fastckpt\xff\xfe", "version": 1}'),
    "manifest-deeply-nested": _raw_manifest(
        b'{"format": "fastckpt", "version": 1, "user": ' + _nested(100_000).encode() + b"}"),
    "manifest-is-a-list": _raw_manifest(b'["fastckpt", 1]'),
    "manifest-version-string": _set("manifest.version", "1"),
    "manifest-step-abc": _set("manifest.step", "abc"),
    "manifest-step-null": _set("manifest.step", None),
    "manifest-step-list": _set("manifest.step", [1]),
    "manifest-step-float": _set("manifest.step", 1.5),
    "manifest-name-number": _set("manifest.name", 7),
    "manifest-nbytes-string": _set("manifest.nbytes", "big"),
    "manifest-files-list": _set("manifest.files", ["a", "b"]),
    "manifest-meta-dotdot": _set("manifest.meta", "../meta.json"),
    "manifest-meta-unlisted": _set("manifest.meta", "meta.other.json"),
    "manifest-file-absolute": lambda c: _rename_listed(c, "/etc/hostname"),
    "manifest-file-size-string": lambda c: _file_record(c, "size", "4096"),
    "manifest-file-crc-huge": lambda c: _file_record(c, "crc32c", 1 << 40),
    # meta files
    "meta-not-json": _raw_meta(b"{not json"),
    "meta-not-utf8": _raw_meta(b'{"tree": "\xc3\x28", "tensors": []}'),
    "meta-deeply-nested-json": _raw_meta(b'{"tensors": [], "tree": ' + _nested(100_000).encode() + b"}"),
    "meta-deep-tree": lambda c: c.commit(meta=json.dumps(c.meta).encode().replace(
        b'"tree": {"D": [', b'"tree": {"D": [["deep", ' + _tree_nested(450) + b"], ", 1)),
    "meta-tensors-dict": _set("meta.tensors", {"a": 1}),
    "meta-objects-dotdot": _set("meta.objects", "../../objects.pt"),
    "meta-tree-bad-index": _set("meta.tree", {"D": [["a", {"T": 99}]]}),
    # Python reads -1 as the last tensor and True as 1: a crafted reference must not load another tensor silently
    "meta-tree-negative-index": _set("meta.tree", {"D": [["a", {"T": -1}]]}),
    "meta-tree-bool-index": _set("meta.tree", {"D": [["a", {"T": True}]]}),
    "meta-tree-negative-object": _set("meta.tree", {"D": [["a", {"P": -1}]]}),
    "meta-tree-bad-node": _set("meta.tree", {"Q": 1}),
    "meta-tree-bad-device": _set("meta.tree", {"D": [["dev", {"dv": "nonsense:99"}]]}),
    "meta-dtensor-bad-block": _set("meta.dtensors", [{"key": "d", "dtype": "float32", "shape": [1 << 40],
                                                      "entries": [-1], "offsets": [[0]]}]),
    # tensor table rows
    "row-file-dotdot": _set("row.a.file", "../shard.safetensors"),
    "row-file-unlisted": _set("row.a.file", "shard-99999.x.safetensors"),
    "row-offset-past-end": _set("row.a.offset", 1 << 62),
    "row-range-past-end": _past_end,
    "row-overlapping-ranges": _overlap,
    "row-offset-negative": _set("row.a.offset", -64),
    "row-offset-float": _set("row.a.offset", 4096.0),
    "row-nbytes-string": _set("row.a.nbytes", "64"),
    "row-dtype-unknown": _set("row.a.dtype", "float128"),
    "row-dtype-not-a-dtype": _set("row.a.dtype", "Tensor"),
    "row-dtype-not-a-name": _set("row.a.dtype", ["float32"]),
    "row-dtype-quantized": _set("row.a.dtype", "qint32"),
    "row-numpy-without-numpy-dtype": lambda c: (c.row("a").update(dtype="bfloat16", shape=[32], numpy=True),
                                                c.commit()),
    "row-dtype-sub-byte": lambda c: (c.row("a").update(dtype="uint4", shape=[64]), c.commit()),
    "row-shape-vs-nbytes": _set("row.a.shape", [5]),
    "row-shape-absurd-zero-bytes": lambda c: (c.row("a").update(shape=[1 << 50, 1 << 10], nbytes=0), c.commit()),
    "row-shape-negative": _set("row.a.shape", [-4, -4]),
    "row-shape-string": _set("row.a.shape", "16"),
    "row-crc-string": _set("row.a.crc32c", "x"),
    "row-not-an-object": _set("meta.tensors", [7]),
    # shard headers
    "shard-header-length-2**63": _shard_header(1 << 63),
    "shard-header-covers-data": _shard_header(1 << 20),
    "shard-truncated-below-header": _truncated_shard,
}


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_checkpoints_are_rejected_with_a_named_error(tmp_path, case, verify) -> None:
    path = _save(tmp_path / "root")
    CRAFTED[case](Ckpt(path))
    with pytest.raises(IntegrityError) as info:
        load_checkpoint(str(path), verify=verify)
    assert str(path) in str(info.value) or "row" in str(info.value)  # the message names what it read
    assert main(["verify", str(path)]) == 1  # the CLI refuses it too, without a traceback


def test_untouched_checkpoint_still_loads_bit_for_bit(tmp_path) -> None:
    path = _save(tmp_path / "root")
    for verify in (True, False):
        assert_bit_equal(_state(), load_checkpoint(str(path), verify=verify))


# ---- 10: planted names and symlinks ----------------------------------------------------


def _move_outside(c: Ckpt, name: str, outside: Path) -> str:
    """Move the listed file ``name`` to ``outside`` and make the manifest and table point there by ``../``."""
    outside.mkdir(exist_ok=True)
    shutil.move(c.path / name, outside / name)
    planted = f"../{outside.name}/{name}"
    c.manifest["files"][planted] = c.manifest["files"].pop(name)
    return planted


def test_a_dotdot_shard_name_is_not_read_outside(tmp_path) -> None:
    c = Ckpt(_save(tmp_path / "root"))
    planted = _move_outside(c, c.shard, tmp_path / "root" / "elsewhere")
    for row in c.meta["tensors"]:
        row["file"] = planted
    c.commit()
    with pytest.raises(UnsafeCheckpointError, match=r"\.\./elsewhere"):
        load_checkpoint(str(c.path))


def test_a_dotdot_meta_name_is_not_read_outside(tmp_path) -> None:
    c = Ckpt(_save(tmp_path / "root"))
    c.commit()
    c.manifest["meta"] = _move_outside(c, c.meta_name, tmp_path / "elsewhere")
    c.write_manifest()
    with pytest.raises(UnsafeCheckpointError, match=r"\.\./elsewhere/meta"):
        load_checkpoint(str(c.path))
    assert main(["verify", str(c.path)]) == 1


def test_a_symlinked_shard_leading_outside_is_refused(tmp_path) -> None:
    c = Ckpt(_save(tmp_path / "root"))
    outside = tmp_path / "outside.safetensors"
    shutil.move(c.path / c.shard, outside)
    os.symlink(outside, c.path / c.shard)
    for verify in (True, False):
        with pytest.raises(UnsafeCheckpointError, match="outside"):
            load_checkpoint(str(c.path), verify=verify)
    assert main(["verify", str(c.path)]) == 1


def _plant_victim(c: Ckpt, victim: Path) -> None:
    victim.write_text("precious")
    c.manifest["files"]["../../" + victim.name] = {"size": 8, "crc32c": crc32c(b"precious")}
    c.write_manifest()


def test_delete_never_removes_a_file_a_planted_manifest_lists_outside(tmp_path) -> None:
    root = tmp_path / "root"
    c = Ckpt(_save(root))
    victim = tmp_path / "victim.txt"
    _plant_victim(c, victim)
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
        ckpt.delete(STEP_NAME).result()
    assert victim.read_text() == "precious"
    assert not c.path.exists()  # the checkpoint itself is gone


def test_resaving_a_name_never_removes_a_file_the_old_manifest_lists_outside(tmp_path) -> None:
    root = tmp_path / "root"
    c = Ckpt(_save(root))
    victim = tmp_path / "victim.txt"
    _plant_victim(c, victim)
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
        ckpt.save(_state(), step=1).wait()
        assert_bit_equal(_state(), ckpt.load())
    assert victim.read_text() == "precious"


def test_retention_never_removes_a_file_a_planted_manifest_lists_outside(tmp_path, caplog) -> None:
    root = tmp_path / "root"
    c = Ckpt(_save(root))
    victim = tmp_path / "victim.txt"
    _plant_victim(c, victim)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with Checkpointer(CheckpointConfig(root=str(root), retention={"keep_last": 1})) as ckpt:
            for step in (2, 3):
                ckpt.save(_state(), step=step).wait()
            assert [i.step for i in ckpt.list()] == [3]
    assert victim.read_text() == "precious"
    assert STEP_NAME in caplog.text  # the planted checkpoint is named in a warning


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def remote_storage(request, tmp_path):
    """The remote tier: a local folder, or the real S3 server."""
    if request.param == "local":
        (tmp_path / "remote").mkdir()
        return LocalStorage(str(tmp_path / "remote"))
    s3 = request.getfixturevalue("s3_root")
    return open_storage(s3.url, s3.storage_options)


def _remote_holds(storage, needle: bytes) -> bool:
    found = []

    def walk(path: str) -> None:
        for name in storage.listdir(path):
            child = storage.join(path, name)
            try:
                found.append(needle in storage.read_bytes(child))
            except (FileNotFoundError, IsADirectoryError, OSError):
                walk(child)
    walk(storage.url)
    return any(found)


def test_resumed_upload_never_sends_a_secret_from_outside_the_root(tmp_path, remote_storage, caplog) -> None:
    root = tmp_path / "root"
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"SECRET-TOKEN" * 8)
    c = Ckpt(_save(root))
    c.manifest["files"]["../../secret.txt"] = {"size": 96, "crc32c": crc32c(secret.read_bytes())}
    c.write_manifest()
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with Checkpointer(CheckpointConfig(root=str(root)), remote_storage=remote_storage) as ckpt:
            assert ckpt.resumed_uploads == []  # the crafted checkpoint is skipped, named in a warning
    assert STEP_NAME in caplog.text
    assert not _remote_holds(remote_storage, b"SECRET-TOKEN")


def test_resumed_upload_never_follows_a_symlinked_file_outside(tmp_path, remote_storage) -> None:
    root = tmp_path / "root"
    c = Ckpt(_save(root))
    secret = tmp_path / "secret.bin"
    data = b"SECRET-TOKEN" * 8
    secret.write_bytes(data)
    os.symlink(secret, c.path / "extra.bin")
    c.manifest["files"]["extra.bin"] = {"size": len(data), "crc32c": crc32c(data)}
    c.write_manifest()
    with Checkpointer(CheckpointConfig(root=str(root)), remote_storage=remote_storage) as ckpt:
        [handle] = ckpt.resumed_uploads
        with pytest.raises(StorageError, match="extra.bin.*outside") as info:
            handle.wait_uploaded()  # the upload failed; the local checkpoint stays committed
        assert isinstance(info.value.__cause__, UnsafeCheckpointError)
    assert not _remote_holds(remote_storage, b"SECRET-TOKEN")


# ---- 14: one malformed manifest never stops a resume ------------------------------------


@pytest.mark.parametrize("bad", [
    b'"abc"', b"null", b"[3]", _nested(100_000).encode(), b'{"$ref": 1}',
], ids=["step-abc", "step-null", "step-list", "step-deeply-nested", "step-object"])
def test_a_malformed_manifest_is_skipped_with_a_warning(tmp_path, bad, caplog, capsys) -> None:
    root = tmp_path / "root"
    for step in (1, 2, 5):
        _save(root, step)
    raw = (root / "step-000000005" / "manifest.json").read_bytes()
    doc = json.loads(raw)
    patched = raw.replace(f'"step": {doc["step"]}'.encode(), b'"step": ' + bad)
    assert patched != raw
    (root / "step-000000005" / "manifest.json").write_bytes(patched)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
            assert [i.step for i in ckpt.list()] == [1, 2]
            assert ckpt.latest() == 2
            assert_bit_equal(_state(), ckpt.load())
    assert "step-000000005" in caplog.text
    capsys.readouterr()
    assert main(["list", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "step-000000002" in out and "Traceback" not in err
    [row] = [line for line in out.splitlines() if "step-000000005" in line]  # shown as damage, never committed
    assert "torn" in row.split() and "committed" not in row.split() and "step-000000005" in err


def test_a_checkpoint_symlinked_into_the_root_is_skipped(tmp_path, caplog) -> None:
    root = tmp_path / "root"
    _save(root, 1)
    elsewhere = _save(tmp_path / "elsewhere", 9)
    os.symlink(elsewhere, root / "step-000000009")
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
            assert ckpt.latest() == 1
    assert "step-000000009" in caplog.text


# ---- 19: fastckpt verify reports every problem, one line each ---------------------------


def _verify_lines(path: Path, capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main(["verify", str(path)])
    return rc, [line for line in capsys.readouterr().err.splitlines() if line]


def test_verify_reports_a_listed_file_that_is_missing(tmp_path, capsys) -> None:
    c = Ckpt(_save(tmp_path / "root"))
    c.manifest["files"]["gone.bin"] = {"size": 3, "crc32c": 0}
    c.commit()
    rc, lines = _verify_lines(c.path, capsys)
    assert rc == 1 and len(lines) == 1 and "gone.bin" in lines[0] and "missing" in lines[0]


def test_verify_reports_an_unreferenced_file_with_a_wrong_checksum(tmp_path, capsys) -> None:
    c = Ckpt(_save(tmp_path / "root"))
    c.write_file("notes.bin", b"hello")
    c.manifest["files"]["notes.bin"]["crc32c"] ^= 1
    c.commit()
    rc, lines = _verify_lines(c.path, capsys)
    assert rc == 1 and len(lines) == 1 and "notes.bin" in lines[0] and "checksum" in lines[0]


def test_verify_reports_shapes_inconsistent_with_byte_counts(tmp_path, capsys) -> None:
    c = Ckpt(_save(tmp_path / "root"))
    c.row("a")["shape"] = [5]
    c.row("b")["shape"] = [4, 5]
    c.commit()
    rc, lines = _verify_lines(c.path, capsys)
    assert rc == 1 and len(lines) == 2
    assert "'a'" in lines[0] + lines[1] and "'b'" in lines[0] + lines[1]
    assert all("bytes" in line for line in lines)


def test_verify_reports_every_problem_on_its_own_line(tmp_path, capsys) -> None:
    c = Ckpt(_save(tmp_path / "root"))
    c.manifest["files"]["gone.bin"] = {"size": 3, "crc32c": 0}
    c.row("a")["shape"] = [5]
    c.commit()
    shard = bytearray((c.path / c.shard).read_bytes())
    shard[-1] ^= 0xFF  # inside b, the last tensor
    (c.path / c.shard).write_bytes(bytes(shard))
    rc, lines = _verify_lines(c.path, capsys)
    assert rc == 1 and len(lines) == 4, lines  # missing file, a's shape, the shard's CRC, b's own CRC
    assert any("gone.bin" in line for line in lines) and any("'b'" in line for line in lines)


# ---- 11: Lightning pointers ---------------------------------------------------------------


def test_a_lightning_pointer_part_outside_dirpath_is_refused(tmp_path) -> None:
    from fastckpt_lightning import FastCheckpointIO
    from fastckpt_lightning.pointer import Pointer

    elsewhere = tmp_path / "elsewhere"
    with Checkpointer(CheckpointConfig(root=str(elsewhere))) as ckpt:
        ckpt.save({"state_dict": {"w": torch.ones(3)}}, step=7, name="step-7.fastckpt").wait()
    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    planted = Pointer(("x",), 7).to_bytes().replace(b'"x"', b'"../elsewhere/step-7.fastckpt"')
    (dirpath / "last.ckpt").write_bytes(planted)
    plugin = FastCheckpointIO()
    try:
        with pytest.raises(UnsafeCheckpointError, match="data folder"):
            plugin.load_checkpoint(str(dirpath / "last.ckpt"))
    finally:
        plugin.teardown()


def test_a_lightning_pointer_part_symlinked_outside_is_refused(tmp_path) -> None:
    from fastckpt_lightning import FastCheckpointIO
    from fastckpt_lightning.pointer import Pointer

    elsewhere = tmp_path / "elsewhere"
    with Checkpointer(CheckpointConfig(root=str(elsewhere))) as ckpt:
        ckpt.save({"state_dict": {"w": torch.ones(3)}}, step=7, name="step-7.fastckpt").wait()
    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    os.symlink(elsewhere / "step-7.fastckpt", dirpath / "last.ckpt.state-1.fastckpt")
    (dirpath / "last.ckpt").write_bytes(Pointer(("last.ckpt.state-1.fastckpt",), 7).to_bytes())
    plugin = FastCheckpointIO()
    try:
        with pytest.raises(UnsafeCheckpointError, match="outside"):
            plugin.load_checkpoint(str(dirpath / "last.ckpt"))
    finally:
        plugin.teardown()


def test_a_lightning_part_with_a_dotdot_meta_name_is_refused(tmp_path) -> None:
    from fastckpt_lightning import FastCheckpointIO
    from fastckpt_lightning.pointer import Pointer

    dirpath = tmp_path / "ckpts"
    with Checkpointer(CheckpointConfig(root=str(dirpath))) as ckpt:
        ckpt.save({"state_dict": {"w": torch.ones(3)}}, step=7, name="last.ckpt.state-1.fastckpt").wait()
    c = Ckpt(dirpath / "last.ckpt.state-1.fastckpt")
    c.manifest["meta"] = _move_outside(c, c.meta_name, tmp_path / "elsewhere")
    c.write_manifest()
    (dirpath / "last.ckpt").write_bytes(Pointer(("last.ckpt.state-1.fastckpt",), 7).to_bytes())
    plugin = FastCheckpointIO()
    try:
        with pytest.raises(UnsafeCheckpointError, match=r"\.\./elsewhere"):
            plugin.load_checkpoint(str(dirpath / "last.ckpt"))
    finally:
        plugin.teardown()


def test_a_crafted_last_pointer_does_not_stop_finding_the_newest(tmp_path, caplog) -> None:
    from fastckpt_lightning.model_checkpoint import find_last_checkpoint
    from fastckpt_lightning.pointer import Pointer

    tmp_path.joinpath("last.ckpt").write_bytes(Pointer(("a.fastckpt",), 3).to_bytes())
    tmp_path.joinpath("last-v1.ckpt").write_bytes(Pointer(("x",), 9).to_bytes().replace(b'"x"', b'"../../etc"'))
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        assert find_last_checkpoint(str(tmp_path)) == str(tmp_path / "last.ckpt")
    assert "last-v1.ckpt" in caplog.text


# ---- 12: Accelerate folders never run pickled code unless the user opts in --------------


class _Payload:
    """Unpickling this creates ``marker``: what a planted ``custom_checkpoint_0.pkl`` would do."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _accelerate_folder(tmp_path: Path):
    from tests.accelerate_testing import Setup, make_accelerator

    acc = make_accelerator(tmp_path, automatic=False)
    setup = Setup(acc)
    setup.step()
    folder = tmp_path / "plain" / "checkpoint_5"
    type(acc).save_state(acc, str(folder))  # Accelerate's own writer
    return acc, setup, folder


def test_a_planted_accelerate_pickle_is_refused(tmp_path) -> None:
    from fastckpt_accelerate import enable

    acc, setup, folder = _accelerate_folder(tmp_path)
    marker = tmp_path / f"ran-{uuid.uuid4().hex}"
    torch.save(_Payload(str(marker)), folder / "custom_checkpoint_0.pkl")
    checkpointing = enable(acc, {"root": str(tmp_path / "ckpts")})
    try:
        with pytest.raises(UnsafeCheckpointError, match=r"custom_checkpoint_0\.pkl.*allow_unsafe_pickle=True"):
            acc.load_state(str(folder))
        assert not marker.exists()
        with pytest.raises(UnsafeCheckpointError, match=r"optimizer\.bin.*allow_unsafe_pickle=True"):
            acc.load_state(str(folder), load_kwargs={"weights_only": False})
        assert not marker.exists()
    finally:
        checkpointing.close()


def test_the_explicit_opt_in_restores_accelerates_own_loading(tmp_path) -> None:
    from fastckpt_accelerate import enable

    acc, setup, folder = _accelerate_folder(tmp_path)
    marker = tmp_path / f"ran-{uuid.uuid4().hex}"
    torch.save(_Payload(str(marker)), folder / "custom_checkpoint_0.pkl")
    checkpointing = enable(acc, {"root": str(tmp_path / "ckpts")}, allow_unsafe_pickle=True)
    try:
        with pytest.raises(TypeError):  # the payload ran (the user trusted the folder); its result is no state dict
            acc.load_state(str(folder))
        assert marker.exists()
    finally:
        checkpointing.close()
