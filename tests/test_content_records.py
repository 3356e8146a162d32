"""Content records (fastckpt/format/contenthash.py): each shard's XXH3-128 ranges in the manifest, hashed on the I/O
workers from the staged bytes, tiling the file, where something reads them (an upload with dedup, clones); a
hostile manifest's records are dropped, never trusted."""
from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any, Iterator

import fsspec
import pytest

import torch
import xxhash

import fastckpt.engine.dedupwrite as dedupwrite_mod
import fastckpt.format.openlayout as openlayout_mod
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.format.contenthash import FIELD, file_records


@pytest.fixture
def remote() -> Iterator[dict]:
    """A remote tier that uploads with dedup (the default): the reader of the records."""
    url = f"memory://fastckpt-records-{uuid.uuid4().hex[:12]}"
    yield {"url": url}
    fs = fsspec.filesystem("memory")
    if fs.exists(url.removeprefix("memory://")):
        fs.rm(url.removeprefix("memory://"), recursive=True)


def _save(tmp_path: Path, **extra: Any) -> Path:
    root = tmp_path / "root"
    ck = Checkpointer(CheckpointConfig(root=str(root), persist={"chunk_bytes": 1 << 20, **extra.pop("persist", {})},
                                       staging={"mode": "eager"}, **extra))
    g = torch.Generator().manual_seed(3)
    ck.save({"a": torch.randn(300_000, generator=g), "b": torch.arange(7, dtype=torch.int16),
             "c": torch.randn(50, 3, generator=g).to(torch.bfloat16)}, step=1)
    ck.close()
    return next(root.glob("*/manifest.json"))


def test_every_shard_lists_records_that_tile_it_with_the_hash_of_its_bytes(tmp_path, remote):
    manifest = _save(tmp_path, remote=remote)
    files = json.loads(manifest.read_text())["files"]
    shards = {n: r for n, r in files.items() if n.startswith("shard-")}
    assert len(shards) >= 2
    for name, rec in shards.items():
        data = (manifest.parent / name).read_bytes()
        recs = file_records(rec, rec["size"])
        assert recs is not None and recs[0].offset == 0 and sum(r.length for r in recs) == len(data)
        for r in recs:
            assert r.digest == xxhash.xxh3_128_hexdigest(data[r.offset: r.offset + r.length])
    assert all(FIELD not in r for n, r in files.items() if not n.startswith("shard-"))


def test_records_are_hashed_on_io_workers_never_the_training_thread(tmp_path, monkeypatch, remote):
    threads: list[str] = []
    real = openlayout_mod.hash_records

    def recording(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(openlayout_mod, "hash_records", recording)
    _save(tmp_path, remote=remote)
    assert threads and threading.current_thread().name not in threads
    assert all(n.startswith(("fastckpt-io-", "fastckpt-boost-")) for n in threads), threads


@pytest.mark.parametrize("how", ["no remote tier", "remote without dedup"])
def test_nothing_reads_records_so_none_are_hashed(tmp_path, monkeypatch, remote, how):
    """A local root without reflinks and no upload with dedup: nothing would ever read the records, so no pass over
    every byte is spent on them (the I/O workers' CPU is taken from training on a busy host); the checkpoint loads
    and verifies as before."""
    calls: list[int] = []
    real = openlayout_mod.hash_records
    monkeypatch.setattr(openlayout_mod, "hash_records", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(dedupwrite_mod, "supports_reflink", lambda url: False)
    extra = {} if how == "no remote tier" else {"remote": {**remote, "dedup": False}}
    manifest = _save(tmp_path, **extra)
    files = json.loads(manifest.read_text())["files"]
    assert calls == [] and not any(FIELD in r for r in files.values())
    with Checkpointer(CheckpointConfig(root=str(manifest.parent.parent))) as ck:
        assert ck.load(1)["b"].tolist() == list(range(7))


def test_a_root_with_reflinks_gets_records_without_a_remote_tier(tmp_path, monkeypatch):
    """Clones need the newest checkpoint's records, so a root whose file system has reflinks keeps them."""
    monkeypatch.setattr(dedupwrite_mod, "supports_reflink", lambda url: True)
    files = json.loads(_save(tmp_path).read_text())["files"]
    assert all(FIELD in r for n, r in files.items() if n.startswith("shard-"))


@pytest.mark.parametrize("reflinks", [False, True])
def test_the_persister_process_lists_records_exactly_when_the_saver_would(tmp_path, monkeypatch, reflinks):
    """The training process's saver decides (``Job.records``) and the persister process follows it per snapshot."""
    monkeypatch.setattr(dedupwrite_mod, "supports_reflink", lambda url: reflinks)
    root = tmp_path / "root"
    config = CheckpointConfig(root=str(root), staging={"shm": True, "shm_dir": str(tmp_path / "shm")},
                              persist={"chunk_bytes": 1 << 20, "fsync": False, "process": "on"})
    with Checkpointer(config) as ck:
        h = ck.save({"a": torch.randn(300_000), "b": torch.arange(7, dtype=torch.int16)}, step=1)
        h.wait()
        assert ck._saver.pipeline.persister.pid is not None  # written by the child, not this process's threads
    files = json.loads(next(root.glob("*/manifest.json")).read_text())["files"]
    shards = [r for n, r in files.items() if n.startswith("shard-")]
    assert shards and all((FIELD in r) is reflinks for r in shards)


def test_malformed_records_are_dropped():
    h = "ab" * 16
    good = {FIELD: [[0, 10, h], [10, 6, h]]}
    assert file_records(good, 16) is not None
    for bad in ([[0, 10, h], [11, 5, h]],  # a gap: bytes no record covers would be copied from nowhere
                [[0, 10, h], [5, 11, h]],  # overlap
                [[0, 16, "z" * 32]],  # not hex
                [[0, 16, h.upper()]],
                [[True, 16, h]],  # a bool is not an offset
                [[0, 16, h, 1]],
                [[0, 0, h], [0, 16, h]],  # an empty record
                "not a list"):
        assert file_records({FIELD: bad}, 16) is None, bad
    assert file_records(good, 17) is None  # does not reach the end
    assert file_records({}, 16) is None and file_records(None, 16) is None
