"""Content records (fastckpt/format/contenthash.py): each shard's XXH3-128 ranges in the manifest, hashed on the I/O
workers from the staged bytes, tiling the file; a hostile manifest's records are dropped, never trusted."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
import xxhash

import fastckpt.format.openlayout as openlayout_mod
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.format.contenthash import FIELD, file_records


def _save(tmp_path: Path) -> Path:
    ck = Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 1 << 20},
                                       staging={"mode": "eager"}))
    g = torch.Generator().manual_seed(3)
    ck.save({"a": torch.randn(300_000, generator=g), "b": torch.arange(7, dtype=torch.int16),
             "c": torch.randn(50, 3, generator=g).to(torch.bfloat16)}, step=1)
    ck.close()
    return next(tmp_path.glob("*/manifest.json"))


def test_every_shard_lists_records_that_tile_it_with_the_hash_of_its_bytes(tmp_path):
    manifest = _save(tmp_path)
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


def test_records_are_hashed_on_io_workers_never_the_training_thread(tmp_path, monkeypatch):
    threads: list[str] = []
    real = openlayout_mod.hash_records

    def recording(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(openlayout_mod, "hash_records", recording)
    _save(tmp_path)
    assert threads and threading.current_thread().name not in threads
    assert all(n.startswith(("fastckpt-io-", "fastckpt-boost-")) for n in threads), threads


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
