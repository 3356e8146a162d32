"""Issue 24's last two CUDA findings on a real device: the copy streams are not torch's pool streams (which NCCL
and FSDP2 take theirs from) and copies on them are bit-exact; with ``staging.shm`` the training thread does not
wait for the GPU inside ``save()``, and the record appears only once the copies landed and were checksummed.
The CPU-side checks are in test_copy_streams.py and test_shm_cuda_staging.py.

Races are widened with ``torch.cuda._sleep`` (as in test_cuda.py) on the stream whose work must come first.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.format.checksum import crc32c
from fastckpt.format.plan import flatten
from fastckpt.storage.local import LocalStorage
from tests.helpers import GatedStorage, assert_bit_equal, clone_state

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

SLEEP = 1_000_000_000  # GPU clock cycles: some hundreds of milliseconds, far longer than any copy below


def _pool_handles(device: int) -> set[int]:
    """Every stream torch's pool hands out on ``device``: 32 per priority, round robin, so 64 draws see them all."""
    highest, lowest = sorted(torch.cuda.Stream.priority_range())  # lower numbers are higher priorities
    with torch.cuda.device(device):
        return {torch.cuda.Stream(priority=p).cuda_stream for p in range(highest, lowest + 1) for _ in range(64)}


def test_copy_streams_are_not_pool_streams_and_copy_bit_exact(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(512, 512).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)  # parameters on the lazy stream, the rest on the eager one
        state = {"m": model.state_dict(), "extra": torch.randn(3000, device="cuda", dtype=torch.float64)}
        ref = clone_state(state)
        ckpt.save(state, step=1).wait(timeout=60)
        d = torch.cuda.current_device()
        lazy, eager = ckpt._saver._streams.lazy(d), ckpt._saver._streams.eager(d)
        pool = _pool_handles(d)
        assert lazy.cuda_stream not in pool and eager.cuda_stream not in pool, "a copy stream is one of torch's pool"
        assert lazy.cuda_stream != eager.cuda_stream
        assert len(pool) >= 32, "the sample of the pool is too small to mean anything"
        # torch caps its range at a few levels; the eager stream takes the device's own highest, at least as high
        assert eager.priority <= min(torch.cuda.Stream.priority_range()) < lazy.priority == 0, (
            "the eager copies must have the device's highest priority, the lazy ones the default")
        assert_bit_equal(ref, ckpt.load(step=1))
    # The streams outlive close(): the allocator uses them when the parameters (record_stream) are freed.
    del model, opt, state
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    x = torch.randn(1024, 1024, device="cuda").t()
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "again"))) as again:
        again.save({"x": x}, step=1).wait(timeout=60)  # strided: a temporary is made on the copy stream
        assert again._saver._streams.eager(d).cuda_stream == eager.cuda_stream, "one stream per device and process"
        assert_bit_equal({"x": x.cpu()}, again.load(step=1))
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def test_load_side_streams_are_not_pool_streams_and_load_bit_exact(tmp_path) -> None:
    """Issue 54 item 11: load_into's side streams came from torch's pool (torch.cuda.Stream()), shared with NCCL's
    and FSDP2's side streams."""
    from fastckpt.read.devicecopy import load_stream

    torch.manual_seed(0)
    state = {"a": torch.randn(300, 300, device="cuda"), "b": torch.arange(7000, device="cuda")}
    ref = clone_state(state)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(state, step=1).wait(timeout=60)
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ckpt.load_into(target, step=1)
        torch.cuda.synchronize()
        assert_bit_equal(ref, target)
    d = torch.cuda.current_device()
    stream = load_stream(d)
    assert load_stream(d) is stream, "one load stream per device for the process"
    assert stream.cuda_stream not in _pool_handles(d), "the load side stream is one of torch's pool"


def test_shm_save_on_gpu_returns_before_the_copies_land(tmp_path, tmpfs_dir) -> None:
    torch.manual_seed(0)
    shm = tmpfs_dir
    cfg = CheckpointConfig(root=str(tmp_path / "ck"), staging={"shm": True, "shm_dir": str(shm)},
                           persist={"chunk_bytes": 1 << 16, "fsync": False})
    storage = GatedStorage(LocalStorage(str(tmp_path / "ck"), fsync=False))  # step 1's record stays uncommitted
    state = {"a": torch.randn(256, 256, device="cuda"), "b": torch.arange(50_000, device="cuda")}
    ref = clone_state(state)
    with Checkpointer(cfg, storage=storage) as ckpt:
        torch.cuda._sleep(SLEEP)  # the copies wait for the kernels queued before save()
        h = ckpt.save(state, step=1)
        # before the fix save() waited for the copies, then wrote the record itself: staged on return
        assert not h.staged(), "save() (or the copy thread) saw the copies done while the GPU was still busy"
        assert list(shm.rglob("staged.json")) == [], "a record exists before its copies landed"
        h.wait_staged(timeout=60)
        [record] = list(shm.rglob("staged.json"))
        doc = json.loads(record.read_text())
        tensors = [t.cpu() for t in flatten(ref).tensors]
        checked = 0
        for index, crcs in doc["crcs"].items():
            data = Path(record.parent, f"shard-{int(index):05d}.bin").read_bytes()
            mine = [i for i, e in enumerate(doc["entries"]) if e[4] == int(index)]
            for i, want in zip(mine, crcs):
                _, _, nbytes, _, _, offset = doc["entries"][i]
                staged = data[offset: offset + nbytes]
                assert staged == tensors[i].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                assert crc32c(staged) == want
                checked += 1
        assert checked == len(tensors)
        storage.gate.set()
        h.wait(timeout=60)
        assert_bit_equal(ref, ckpt.load(step=1))
