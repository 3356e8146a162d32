"""Unchanged bytes are never re-sent (tiers/dedup.py, storage/s3copy.py) against a real SeaweedFS, through a proxy
that counts every byte the client sends."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch


# the GPU machine has no s3fs (benchmarks/gpu.sh): skipped there, with the reason, not a collection error
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (the S3 tests need it)")
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.format.layout import MANIFEST
from fastckpt.storage.partplan import MIN_PART
from tests.helpers import assert_bit_equal

MiB = 1 << 20
FROZEN = 4  # frozen tensors of 8 MiB each: 32 MiB that never change (each over S3's 5 MiB part minimum)
SMALL = 16 * 1024  # the trained tensor between each pair of frozen ones (a LoRA adapter's size)


class _Counter:
    """Bytes the client sent through the proxy, and a hook run when a request first shows a copy header."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.up = 0
        self.on_copy = None

    def __call__(self, data: bytes, upload: bool) -> bytes:
        if upload:
            with self.lock:
                self.up += len(data)
            if self.on_copy is not None and b"x-amz-copy-source" in data.lower():
                hook, self.on_copy = self.on_copy, None
                hook()  # before the copy request reaches the server
        return data


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(1)
    frozen = [torch.randn(2 * MiB, generator=g) for _ in range(FROZEN)]  # the same every step
    t = torch.Generator().manual_seed(100 + step)
    model = {}
    for i, f in enumerate(frozen):
        model[f"frozen{i}"] = f
        model[f"lora{i}"] = torch.randn(SMALL // 4, generator=t)
    return {"model": model, "step": step}


@pytest.fixture
def counted(s3_fault_proxy):
    counter = _Counter()
    s3_fault_proxy.proxy.rewrite = counter
    yield s3_fault_proxy, counter
    s3_fault_proxy.proxy.rewrite = None


def _ck(tmp_path: Path, proxied, url: str, dedup: bool = True) -> Checkpointer:
    return Checkpointer(CheckpointConfig(
        root=str(tmp_path / "local"), persist={"chunk_bytes": 64 * MiB}, staging={"mode": "eager"},
        remote={"url": url, "storage_options": proxied.storage_options, "dedup": dedup}))


def _direct(proxied) -> s3fs.S3FileSystem:
    """A client straight to the server (not counted, not proxied)."""
    return s3fs.S3FileSystem(**proxied.server.storage_options)


def _name(step: int) -> str:
    return f"step-{step:09d}"


def _save_twice(tmp_path, proxied, counter, url, dedup=True) -> tuple[Checkpointer, int, int, int]:
    """Two saves; returns the bytes through the proxy for each, and the bytes the second sent by its stats."""
    ck = _ck(tmp_path, proxied, url, dedup)
    ck.save(_state(1), step=1)
    ck.wait()
    first, before = counter.up, ck.upload_checksums.dedup.sent
    counter.up = 0
    ck.save(_state(2), step=2)
    ck.wait()
    return ck, first, counter.up, ck.upload_checksums.dedup.sent - before


def _remote_shards(fs: s3fs.S3FileSystem, url: str, name: str) -> list[str]:
    return sorted(p for p in fs.ls(f"{url.removeprefix('s3://')}/{name}") if p.endswith(".safetensors"))


def test_second_save_sends_only_the_changed_bytes_and_the_object_is_whole(tmp_path, counted):
    proxied, counter = counted
    url = proxied.fresh_url("dedup")
    ck, first, second, sent = _save_twice(tmp_path, proxied, counter, url)
    try:
        stats = ck.upload_checksums.dedup
        shard_size = 4096 + FROZEN * (8 * MiB + SMALL)
        changed = FROZEN * SMALL + 4096  # the adapters and the header (its step changed)
        # each changed region (header + adapter, then each adapter) costs at most one 5 MiB part; + the meta file
        assert changed <= sent <= FROZEN * MIN_PART + 64 * 1024
        assert stats.copied >= shard_size - FROZEN * MIN_PART and stats.fell_back == 0
        assert stats.unverified_copies == 0  # SeaweedFS returns each copied part's CRC32C: all checked
        assert first > shard_size and second <= sent + 256 * 1024  # on the wire: + HTTP headers and the manifest
        fs = _direct(proxied)
        local = sorted((tmp_path / "local" / _name(2)).glob("*.safetensors"))
        remote = _remote_shards(fs, url, _name(2))
        assert len(local) == len(remote) == 1 and local[0].stat().st_size == shard_size
        assert fs.cat_file(remote[0]) == local[0].read_bytes()  # bit-identical to what a full upload sends
        # and stock-readable: safetensors in a process that never imports fastckpt
        dest = tmp_path / "dl.safetensors"
        dest.write_bytes(fs.cat_file(remote[0]))
        code = textwrap.dedent(f"""
            import sys, torch
            from safetensors.torch import load_file
            t = load_file({str(dest)!r})
            assert "fastckpt" not in sys.modules
            torch.save(t, {str(tmp_path / 'plain.pt')!r})
        """)
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        plain = torch.load(tmp_path / "plain.pt")
        want = _state(2)["model"]
        for k, v in want.items():
            assert torch.equal(plain[f"model/{k}"] if f"model/{k}" in plain else plain[k], v)
    finally:
        ck.close()


def test_dedup_off_sends_the_whole_file_again(tmp_path, counted):
    proxied, counter = counted
    ck, first, second, sent = _save_twice(tmp_path, proxied, counter, proxied.fresh_url("nodedup"), dedup=False)
    try:
        assert second > FROZEN * 8 * MiB and ck.upload_checksums.dedup.copied == 0
    finally:
        ck.close()


def test_source_deleted_before_the_copy_falls_back_to_sending(tmp_path, counted):
    proxied, counter = counted
    url = proxied.fresh_url("gone")
    ck = _ck(tmp_path, proxied, url)
    try:
        ck.save(_state(1), step=1)
        ck.wait()
        old = _name(1)
        fs = _direct(proxied)
        old_shards = _remote_shards(fs, url, old)
        counter.on_copy = lambda: fs.rm(old_shards)  # retention elsewhere deletes the source mid-upload
        ck.save(_state(2), step=2)
        ck.wait()
        stats = ck.upload_checksums.dedup
        assert stats.fell_back > 0, "the copy whose source was deleted must have been sent instead"
        new = _name(2)
        local = sorted((tmp_path / "local" / new).glob("*.safetensors"))
        assert fs.cat_file(_remote_shards(fs, url, new)[0]) == local[0].read_bytes()
    finally:
        ck.close()


def test_older_checkpoint_deleted_afterwards_newer_still_loads_bit_exact(tmp_path, counted):
    proxied, counter = counted
    url = proxied.fresh_url("retain")
    ck, _, _, _ = _save_twice(tmp_path, proxied, counter, url)
    assert ck.upload_checksums.dedup.copied > 0
    ck.close()
    fs = _direct(proxied)
    base = url.removeprefix("s3://")
    assert fs.exists(f"{base}/{_name(1)}/{MANIFEST}")
    fs.rm(f"{base}/{_name(1)}", recursive=True)  # retention (here, by hand) deletes the copy source
    # a fresh process-like reader: empty local root, the remote tier only
    reader = Checkpointer(CheckpointConfig(root=str(tmp_path / "empty"), remote={
        "url": url, "storage_options": proxied.server.storage_options}))
    try:
        assert_bit_equal(reader.load(step=2), _state(2))
    finally:
        reader.close()


def test_a_copy_whose_bytes_differ_from_the_local_ones_is_sent_instead(tmp_path, counted):
    """The previous remote shard was replaced by other bytes of the same size (its manifest still lists the old
    hashes): each copied part's CRC32C, as the store returns it, differs from the local bytes' -> sent."""
    proxied, counter = counted
    url = proxied.fresh_url("tampered")
    ck = _ck(tmp_path, proxied, url)
    try:
        ck.save(_state(1), step=1)
        ck.wait()
        fs = _direct(proxied)
        (old,) = _remote_shards(fs, url, _name(1))
        size = fs.size(old)
        fs.pipe_file(old, bytes(size))  # same size, all zeros
        ck.save(_state(2), step=2)
        ck.wait()
        stats = ck.upload_checksums.dedup
        assert stats.fell_back > 0 and stats.copied == 0
        local = sorted((tmp_path / "local" / _name(2)).glob("*.safetensors"))
        assert fs.cat_file(_remote_shards(fs, url, _name(2))[0]) == local[0].read_bytes()
    finally:
        ck.close()


def test_remote_retention_deletes_each_source_and_every_newer_checkpoint_stays_whole(tmp_path, counted):
    """remote.keep_last=1: each upload copies from the previous checkpoint, which retention then deletes."""
    proxied, counter = counted
    url = proxied.fresh_url("keep1")
    ck = Checkpointer(CheckpointConfig(
        root=str(tmp_path / "local"), persist={"chunk_bytes": 64 * MiB}, staging={"mode": "eager"},
        remote={"url": url, "storage_options": proxied.storage_options, "keep_last": 1}))
    try:
        for step in (1, 2, 3):
            ck.save(_state(step), step=step)
            ck.wait()
        assert ck.upload_checksums.dedup.copied >= 2 * FROZEN * 8 * MiB - 4 * FROZEN * MIN_PART
    finally:
        ck.close()
    fs = _direct(proxied)
    base = url.removeprefix("s3://")
    assert not fs.exists(f"{base}/{_name(1)}") and not fs.exists(f"{base}/{_name(2)}")
    reader = Checkpointer(CheckpointConfig(root=str(tmp_path / "empty"), remote={
        "url": url, "storage_options": proxied.server.storage_options}))
    try:
        assert_bit_equal(reader.load(step=3), _state(3))
    finally:
        reader.close()
