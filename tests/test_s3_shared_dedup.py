"""Unchanged bytes are never re-sent when the ranks share one object's upload (``save_file`` with
``distributed=True`` on ``s3://``, ``fastckpt.engine.shareddedup``): 2 gloo ranks save a state with 24 MiB of
frozen tensors and small changing ones twice, through a proxy that counts every byte the ranks send to SeaweedFS.
Each save is its own launch, so the copy source is found by its records sidecar, as a resumed run finds it."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


# the GPU machine has no s3fs (benchmarks/gpu.sh): skipped there, with the reason, not a collection error
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (the S3 tests need it)")
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.format.torchrecords import records_path
from fastckpt.storage.partplan import MIN_PART
from tests.dist_launcher import run_ranks
from tests.helpers import assert_bit_equal, assert_same_torch_file
from tests.test_s3_dedup import counted  # noqa: F401 - a fixture
from tests.test_s3_dedup_direct import _child_loads

pytestmark = pytest.mark.slow
MiB = 1 << 20
FROZEN = 3  # 8 MiB tensors that never change (each over S3's 5 MiB part minimum)
SMALL = 16 * 1024  # the trained tensor after each frozen one
SLACK = 256 * 1024  # HTTP headers, the markers, the sidecar


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(1)
    t = torch.Generator().manual_seed(100 + step)
    model = {}
    for i in range(FROZEN):
        model[f"frozen{i}"] = torch.randn(2 * MiB, generator=g)  # the same every step
        model[f"lora{i}"] = torch.randn(SMALL // 4, generator=t)
    return {"state_dict": model, "global_step": step}


def _save(rank: int, world: int, url: str, options: dict, name: str, step: int, out: str) -> None:
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=f"node{rank}-")  # no local folder in common: simulated nodes
    config = CheckpointConfig(root=url, storage_options=options, orphan_grace_s=0, persist={"chunk_bytes": 4 * MiB})
    with Checkpointer(config, distributed=True) as ckpt:
        handle = ckpt.save_file(_state(step), name, step=step)
        handle.wait()
        written = [None] * world
        dist.all_gather_object(written, handle.stats.written_bytes)
        if rank == 0:
            Path(out, f"{name}.json").write_text(json.dumps(written))


def _fs(proxied) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(**proxied.server.storage_options)  # straight to the server, not counted


def _single_writer(tmp_path: Path) -> bytes:
    """What one process's save_file writes of step 2 (a local root)."""
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "local"), persist={"fsync": False})) as ck:
        ck.save_file(_state(2), "b.ckpt").wait()
    return (tmp_path / "local" / "b.ckpt").read_bytes()



def _twice(tmp_path: Path, proxied, counter, url: str, between=None) -> tuple[int, int, list[int]]:
    """a.ckpt, then b.ckpt, each saved by 2 ranks; (bytes on the wire of each launch, b's bytes each rank sent)."""
    run_ranks(_save, 2, url, proxied.storage_options, "a.ckpt", 1, str(tmp_path))
    first, counter.up = counter.up, 0
    if between is not None:
        between()
    run_ranks(_save, 2, url, proxied.storage_options, "b.ckpt", 2, str(tmp_path))
    return first, counter.up, json.loads((tmp_path / "b.ckpt.json").read_text())


def test_ranks_copy_the_previous_files_unchanged_ranges(tmp_path, counted):
    proxied, counter = counted
    url = proxied.fresh_url("shareddedup")
    first, second, written = _twice(tmp_path, proxied, counter, url)
    frozen = FROZEN * 8 * MiB
    assert first > frozen  # nothing to copy from
    # changed: the pickle (its step), each adapter and the central directory; each region one part of slack at most
    changed = FROZEN * SMALL + 4096
    assert second <= changed + (FROZEN + 1) * MIN_PART + SLACK, f"sent {second} bytes on the wire"
    assert sum(written) <= changed + (FROZEN + 1) * MIN_PART, written
    fs = _fs(proxied)
    base = url.removeprefix("s3://")
    assert fs.exists(records_path(f"{base}/b.ckpt"))  # the next file's copy source
    data = fs.cat_file(f"{base}/b.ckpt")
    assert_same_torch_file(data, _single_writer(tmp_path))
    fs.rm(f"{base}/a.ckpt")  # the copy source goes: the newer file is complete on its own
    fs.invalidate_cache()
    assert_bit_equal(_child_loads(tmp_path, fs.cat_file(f"{base}/b.ckpt"), "ckpt"), _state(2))


def test_a_forged_sidecar_costs_bytes_never_a_wrong_object(tmp_path, counted, capsys):
    """a.ckpt's sidecar names it rightly (size, stored CRC32C) but its frozen tensors' hashes are swapped round: every
    copy's CRC32C differs from the owner's local bytes, so each such part is sent instead."""
    proxied, counter = counted
    url = proxied.fresh_url("sharedforged")
    fs = _fs(proxied)
    side = records_path(f"{url.removeprefix('s3://')}/a.ckpt")

    def forge() -> None:
        doc = json.loads(fs.cat_file(side))
        big = [r for r in doc["xxh3_128"] if r[1] == 8 * MiB]
        assert len(big) == FROZEN
        hashes = [r[2] for r in big]
        for r, h in zip(big, hashes[1:] + hashes[:1]):
            r[2] = h
        fs.pipe_file(side, json.dumps(doc).encode())

    _, second, written = _twice(tmp_path, proxied, counter, url, between=forge)
    assert "sending it instead" in capsys.readouterr().out, "the copies were tried, and refused by their CRC32C"
    assert sum(written) >= FROZEN * 8 * MiB and second >= FROZEN * 8 * MiB
    data = fs.cat_file(f"{url.removeprefix('s3://')}/b.ckpt")
    assert_same_torch_file(data, _single_writer(tmp_path))
    assert_bit_equal(_child_loads(tmp_path, data, "ckpt"), _state(2))


def test_a_copied_parts_crc32c_comes_from_every_ranks_pieces_without_moving_bytes():
    """Rank 0 checks a copy against the CRC32C of bytes it does not hold: the ranks' pieces, combined."""
    import crc32c

    from fastckpt.engine.partplan import Part
    from fastckpt.engine.shareddedup import expected_crc, piece_crcs

    data = bytes(range(256)) * 100  # the object: fixed [0, 100), rank 1's record [100, 20000), rank 0's to the end
    records = [(100, 19900, 1), (20000, len(data) - 20000, 0)]
    views = {0: memoryview(data)[100:20000], 1: memoryview(data)[20000:]}
    fixed = [(0, data[:100])]
    part = Part(1, 0, 25000, 0)
    pieces = [pc for rank in (0, 1) for pc in piece_crcs([part], {1: ("s3://b/a.ckpt", 0)}, records, views, rank)]
    assert expected_crc(part, pieces, fixed) == crc32c.crc32c(data[:25000])
    assert expected_crc(part, pieces[1:], fixed) is None  # a rank's piece missing: sent, never copied unchecked
