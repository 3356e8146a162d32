"""Unchanged bytes are never re-sent when the root itself is on S3 (no local tier): the open layout's shards
(engine/dedupwrite.py, format/objectdedup.py) and torch files from ``save_file`` (format/torchrecords.py: the
previous ``.ckpt``'s records come from its sidecar), against a real SeaweedFS through a proxy that counts every
byte the client sends."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

# the GPU machine has no s3fs (benchmarks/gpu.sh): skipped there, with the reason, not a collection error
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (the S3 tests need it)")
import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.format.torchrecords import records_path
from fastckpt.storage.partplan import MIN_PART
from tests.helpers import assert_bit_equal, run_child
from tests.test_s3_dedup import FROZEN, SMALL, _name, _state, counted  # noqa: F401 - counted is a fixture

MiB = 1 << 20
SLACK = 256 * 1024  # HTTP headers, the meta file, the manifest, the sidecars


def _ck(url: str, options: dict, dedup: bool = True) -> Checkpointer:
    return Checkpointer(CheckpointConfig(root=url, storage_options=options, persist={"chunk_bytes": 64 * MiB},
                                         staging={"mode": "eager"}, remote={"dedup": dedup}))


def _fs(proxied) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(**proxied.server.storage_options)  # straight to the server, not counted


def _shards(fs: s3fs.S3FileSystem, url: str, name: str) -> list[str]:
    return sorted(p for p in fs.ls(f"{url.removeprefix('s3://')}/{name}") if p.endswith(".safetensors"))


def _child_loads(tmp_path: Path, data: bytes, kind: str) -> dict:
    """``data`` loaded by a process that never imports fastckpt (safetensors or plain torch.load), returned as the
    tensors it read (torch.save'd by the child, read back here)."""
    src, out = tmp_path / f"dl.{kind}", tmp_path / "plain.pt"
    src.write_bytes(data)
    load = ("from safetensors.torch import load_file; t = load_file(sys.argv[1])" if kind == "safetensors"
            else "t = torch.load(sys.argv[1], weights_only=True)")
    code = textwrap.dedent(f"""
        import sys, torch
        {load}
        assert "fastckpt" not in sys.modules
        torch.save(t, sys.argv[2])
    """)
    done = run_child(code, str(src), str(out))
    assert done.returncode == 0, done.stderr
    return torch.load(out, weights_only=True)


def test_direct_root_second_save_sends_only_the_changed_bytes(tmp_path, counted):
    proxied, counter = counted
    url = proxied.fresh_url("direct")
    ck = _ck(url, proxied.storage_options)
    try:
        ck.save(_state(1), step=1)
        ck.wait()
        first, counter.up = counter.up, 0
        ck.save(_state(2), step=2)
        ck.wait()
        second = counter.up
        stats = ck._saver.dedup
    finally:
        ck.close()
    shard_size = 4096 + FROZEN * (8 * MiB + SMALL)
    assert first > shard_size  # the first save had nothing to copy from
    # each changed region (header + adapter, then each adapter) costs at most one 5 MiB part of slack
    assert second <= FROZEN * MIN_PART + SLACK, f"sent {second} bytes"
    assert stats.copied >= shard_size - FROZEN * MIN_PART and stats.fell_back == 0
    fs = _fs(proxied)
    (new,) = _shards(fs, url, _name(2))
    # bit-identical to a full upload of the same save (dedup off, another root)
    full_url = proxied.fresh_url("full")
    full = _ck(full_url, proxied.storage_options, dedup=False)
    try:
        full.save(_state(2), step=2)
        full.wait()
    finally:
        full.close()
    (whole,) = _shards(fs, full_url, _name(2))
    data = fs.cat_file(new)
    assert data == fs.cat_file(whole) and len(data) == shard_size
    plain = _child_loads(tmp_path, data, "safetensors")
    for k, v in _state(2)["model"].items():
        assert torch.equal(plain[f"model/{k}"], v)
    # the copy source deleted afterwards: the newer checkpoint still loads bit-exact
    fs.rm(f"{url.removeprefix('s3://')}/{_name(1)}", recursive=True)
    reader = _ck(url, proxied.server.storage_options)
    try:
        assert_bit_equal(reader.load(step=2), _state(2))
    finally:
        reader.close()


def test_direct_root_resumed_run_copies_from_the_newest_checkpoint(tmp_path, counted):
    """A new process on the same root: its first save finds the newest committed checkpoint by name."""
    proxied, counter = counted
    url = proxied.fresh_url("resumed")
    ck = _ck(url, proxied.storage_options)
    try:
        ck.save(_state(1), step=1)
        ck.wait()
    finally:
        ck.close()
    counter.up = 0
    ck = _ck(url, proxied.storage_options)
    try:
        ck.save(_state(2), step=2)
        ck.wait()
        assert ck._saver.dedup.copied > 0
    finally:
        ck.close()
    assert counter.up <= FROZEN * MIN_PART + SLACK
    reader = _ck(url, proxied.server.storage_options)
    try:
        assert_bit_equal(reader.load(step=2), _state(2))
    finally:
        reader.close()


def _file_state(step: int) -> dict:
    return {"state_dict": _state(step)["model"], "global_step": step}


def _save_files(url: str, proxied, counter, between=None) -> tuple[Checkpointer, int]:
    """a.ckpt then b.ckpt by save_file; returns the Checkpointer and the bytes b.ckpt sent."""
    ck = _ck(url, proxied.storage_options)
    ck.save_file(_file_state(1), "a.ckpt").wait()
    if between is not None:
        between()
    counter.up = 0
    ck.save_file(_file_state(2), "b.ckpt").wait()
    return ck, counter.up


def _expected_file(tmp_path: Path) -> bytes:
    """What save_file writes for step 2 without dedup: the same bytes, written to a local root."""
    ck = Checkpointer(CheckpointConfig(root=str(tmp_path / "local"), persist={"fsync": False}))
    try:
        ck.save_file(_file_state(2), "b.ckpt").wait()
    finally:
        ck.close()
    return (tmp_path / "local" / "b.ckpt").read_bytes()


def _check_file(tmp_path: Path, data: bytes) -> None:
    assert data == _expected_file(tmp_path)
    plain = _child_loads(tmp_path, data, "ckpt")
    assert_bit_equal(plain, _file_state(2))


def test_save_file_on_s3_copies_the_previous_files_unchanged_records(tmp_path, counted):
    proxied, counter = counted
    url = proxied.fresh_url("ckpt")
    ck, sent = _save_files(url, proxied, counter)
    try:
        stats = ck._saver.dedup
        assert sent <= FROZEN * MIN_PART + SLACK, f"sent {sent} bytes"
        assert stats.copied >= FROZEN * 8 * MiB - FROZEN * MIN_PART and stats.fell_back == 0
        fs = _fs(proxied)
        base = url.removeprefix("s3://")
        assert fs.exists(records_path(f"{base}/b.ckpt"))
        ck.remove_file("a.ckpt").result()  # the copy source and its sidecars go
        assert not fs.exists(f"{base}/a.ckpt") and not fs.exists(records_path(f"{base}/a.ckpt"))
        _check_file(tmp_path, fs.cat_file(f"{base}/b.ckpt"))
    finally:
        ck.close()


def test_save_file_with_a_stale_sidecar_sends_everything(tmp_path, counted):
    """a.ckpt replaced by other bytes of the same size behind fastckpt's back: its sidecar no longer matches."""
    proxied, counter = counted
    url = proxied.fresh_url("stale")
    fs = _fs(proxied)
    a = f"{url.removeprefix('s3://')}/a.ckpt"
    ck, sent = _save_files(url, proxied, counter, between=lambda: fs.pipe_file(a, bytes(fs.size(a))))
    try:
        # not even tried: the sidecar's size and CRC32C no longer match the object (no copy fell back)
        assert sent >= FROZEN * 8 * MiB and ck._saver.dedup.copied == ck._saver.dedup.fell_back == 0
        _check_file(tmp_path, fs.cat_file(a.replace("a.ckpt", "b.ckpt")))
    finally:
        ck.close()


def test_save_file_with_a_forged_sidecar_sends_everything(tmp_path, counted):
    """A sidecar that names a.ckpt rightly (size, stored CRC32C) but whose records lie about which bytes lie where
    (the frozen tensors' hashes swapped round): every copy's CRC32C differs from the local bytes -> sent."""
    proxied, counter = counted
    url = proxied.fresh_url("forged")
    fs = _fs(proxied)
    side = records_path(f"{url.removeprefix('s3://')}/a.ckpt")

    def forge() -> None:
        doc = json.loads(fs.cat_file(side))
        big = [r for r in doc["xxh3_128"] if r[1] == 8 * MiB]
        hashes = [r[2] for r in big]
        for r, h in zip(big, hashes[1:] + hashes[:1]):
            r[2] = h
        fs.pipe_file(side, json.dumps(doc).encode())

    ck, sent = _save_files(url, proxied, counter, between=forge)
    try:
        stats = ck._saver.dedup
        assert stats.copied == 0 and stats.fell_back >= FROZEN * 8 * MiB - FROZEN * MIN_PART
        _check_file(tmp_path, fs.cat_file(side.replace(".a.ckpt.fastckpt-records", "b.ckpt")))
    finally:
        ck.close()


def test_save_file_with_a_malformed_sidecar_sends_everything(tmp_path, counted):
    proxied, counter = counted
    url = proxied.fresh_url("malformed")
    fs = _fs(proxied)
    side = records_path(f"{url.removeprefix('s3://')}/a.ckpt")
    ck, sent = _save_files(url, proxied, counter, between=lambda: fs.pipe_file(side, b'{"format": "fastckpt-rec'))
    try:
        assert sent >= FROZEN * 8 * MiB and ck._saver.dedup.copied == ck._saver.dedup.fell_back == 0
        _check_file(tmp_path, fs.cat_file(side.replace(".a.ckpt.fastckpt-records", "b.ckpt")))
    finally:
        ck.close()


def test_save_file_replacing_the_same_name_copies_from_its_older_self(tmp_path, counted):
    """last.ckpt saved again: the copy source is the object being replaced (S3 copies from it until the new upload
    completes), and the sidecar left afterwards is the new file's."""
    proxied, counter = counted
    url = proxied.fresh_url("same")
    ck = _ck(url, proxied.storage_options)
    try:
        ck.save_file(_file_state(1), "b.ckpt").wait()
        counter.up = 0
        ck.save_file(_file_state(2), "b.ckpt").wait()
        assert counter.up <= FROZEN * MIN_PART + SLACK and ck._saver.dedup.fell_back == 0
        fs = _fs(proxied)
        b = f"{url.removeprefix('s3://')}/b.ckpt"
        _check_file(tmp_path, fs.cat_file(b))
        assert json.loads(fs.cat_file(records_path(b)))["size"] == fs.size(b)
    finally:
        ck.close()
