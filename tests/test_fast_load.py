"""Fast resume (issue 13): parallel verified reads, load_into straight into the target, load stats."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid

import pytest
import torch

from fastckpt import (CheckpointConfig, Checkpointer, FsspecStorage, IntegrityError, StateMismatchError,
                      StorageError)
from fastckpt.read.readers import PIECE_BYTES
from tests.faultproxy import Mode
from tests.helpers import assert_bit_equal

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64]


def _typed_state() -> dict:
    g = torch.Generator().manual_seed(0)
    state: dict = {}
    for dt in _DTYPES:
        if dt is torch.bool:
            state[str(dt)] = torch.rand(1000, generator=g) > 0.5
        elif dt is torch.int64:
            state[str(dt)] = torch.randint(-2**62, 2**62, (333, 3), generator=g)
        else:
            state[str(dt)] = torch.randn(257, 33, generator=g).to(dt)
    state["big"] = torch.randn(PIECE_BYTES // 4 * 2 + 123, generator=g)  # three pieces, the last one short
    state["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    state["step"] = 7
    return state


def _zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def test_load_into_is_bit_exact_in_place_across_dtypes(tmp_path) -> None:
    state = _typed_state()
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(state, step=1).wait()
        target = _zeros_like(state)
        ptrs = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
        out = ckpt.load_into(target)
        stats = ckpt.last_load_stats
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(target[k], v), k  # the target's own tensors hold the saved bytes
            assert target[k].data_ptr() == ptrs[k] and out[k] is target[k], k
    assert out["step"] == 7
    assert stats is not None and (stats.tier, stats.method, stats.step, stats.verified) == ("local", "into", 1, True)
    assert stats.nbytes == sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def test_the_checkpoint_reader_is_what_read_into_reads_through(tmp_path) -> None:
    # read/load_into.py never imports the loader that calls it (tests/test_layering.py): it states what it reads
    # through as a Protocol; the reader must stay one, its read plan's files too
    from fastckpt.read.load_into import TableReader, TensorFile
    from fastckpt.read.loader import CheckpointReader
    from fastckpt.storage.protocol import open_storage

    state = _typed_state()
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(state, step=1).wait()
        path = ckpt.list()[-1].path
    reader = CheckpointReader(open_storage(str(tmp_path)), path)
    assert isinstance(reader, TableReader)
    assert reader.read_plan() and all(isinstance(f, TensorFile) for f in reader.read_plan())


def test_load_into_copies_into_a_non_contiguous_target(tmp_path) -> None:
    """A transposed target cannot take the bytes directly: they go through a buffer and a copy."""
    w = torch.randn(64, 48)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save({"w": w}, step=1).wait()
        target = torch.zeros(48, 64).t()
        assert not target.is_contiguous()
        ckpt.load_into({"w": target})
    assert torch.equal(target, w)


def test_load_into_a_dtype_mismatch_is_an_error_not_a_cast(tmp_path) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save({"w": torch.randn(8, 8)}, step=1).wait()
        with pytest.raises(StateMismatchError, match=r"'w' is torch.float32 \[8, 8\] in the checkpoint but "
                                                     r"torch.float16"):
            ckpt.load_into({"w": torch.zeros(8, 8, dtype=torch.float16)})


def test_load_into_an_optimizer_whose_state_is_not_initialised(tmp_path) -> None:
    """A fresh AdamW has no exp_avg yet: load_into fills the model in place and builds the optimizer
    state as new tensors; ``load_state_dict`` then installs it (docs/API.md: build, then load)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, step=1).wait()
        model2 = torch.nn.Linear(32, 16)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)
        assert not opt2.state
        out = ckpt.load_into({"model": model2.state_dict(), "optim": opt2.state_dict()})
        opt2.load_state_dict(out["optim"])
    assert_bit_equal(model.state_dict(), model2.state_dict())
    assert_bit_equal(opt.state_dict(), opt2.state_dict())


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_tensor_is_detected_during_the_parallel_read_into_the_target(tmp_path) -> None:
    state = {"a": torch.randn(1 << 20), "b": torch.randn(PIECE_BYTES // 4 + 5)}  # "b" spans two pieces
    with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"workers": 4})) as ckpt:
        ckpt.save(state, step=1).wait()
        folder = ckpt.list()[-1].path
        meta = json.loads(open(os.path.join(folder, next(f for f in os.listdir(folder) if f.startswith("meta")))).read())
        row = next(r for r in meta["tensors"] if r["key"] == "b")
        shard = os.path.join(folder, row["file"])
        _flip_byte(shard, row["offset"] + row["nbytes"] - 3)  # in the second piece of "b"
        with pytest.raises(IntegrityError) as ei:
            ckpt.load_into(_zeros_like(state))
    assert shard in str(ei.value) and "'b'" in str(ei.value) and "load again" in str(ei.value)


class _RendezvousStorage(FsspecStorage):
    """memory:// whose ranged reads of one file wait for each other: a serial reader never gets past."""

    def __init__(self, url: str) -> None:
        super().__init__(url, {})
        self.barrier = threading.Barrier(2, timeout=60)
        self.armed = False

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        if self.armed and path.endswith(".safetensors"):
            self.barrier.wait()  # two pieces of the shard in flight at once, or BrokenBarrierError
        super().read_into(path, offset, out)


def test_remote_shard_is_read_as_concurrent_verified_pieces() -> None:
    url = f"memory://fastckpt-fast-{uuid.uuid4().hex}"
    storage = _RendezvousStorage(url)
    state = {"w": torch.randn(PIECE_BYTES // 4 + 1000)}  # one shard of two pieces
    with Checkpointer(CheckpointConfig(root=url, persist={"workers": 2}), storage=storage) as ckpt:
        ckpt.save(state, step=1).wait()
        storage.armed = True
        got = ckpt.load()
        stats = ckpt.last_load_stats
    assert torch.equal(got["w"], state["w"])
    assert stats is not None and (stats.tier, stats.method) == ("remote", "read")


def test_remote_corrupt_piece_names_the_file_and_tensor() -> None:
    url = f"memory://fastckpt-fast-{uuid.uuid4().hex}"
    state = {"a": torch.randn(1000), "w": torch.randn(PIECE_BYTES // 4 + 1000)}
    with Checkpointer(CheckpointConfig(root=url, persist={"workers": 2})) as ckpt:
        ckpt.save(state, step=1).wait()
        fs = ckpt.storage.fs  # type: ignore[attr-defined]
        shard = next(p for p in fs.find(url.removeprefix("memory://")) if p.endswith(".safetensors"))
        data = bytearray(fs.cat_file(shard))
        data[-10] ^= 0xFF  # in the last piece, inside "w"
        fs.pipe_file(shard, bytes(data))
        with pytest.raises(IntegrityError, match=r"checksum mismatch in tensor 'w'") as ei:
            ckpt.load()
    assert shard.lstrip("/") in str(ei.value)


_RSS_CHILD = r"""
import sys, torch
from fastckpt import CheckpointConfig, Checkpointer
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
n = int(sys.argv[2])
target = {"w": torch.zeros(n // 4), "v": torch.zeros(n // 8, dtype=torch.float64)}
for t in target.values():
    t.fill_(1.0)  # every page of the model resident before the measurement starts
ckpt = Checkpointer(CheckpointConfig(root=sys.argv[1]))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS now (ru_maxrss would remember the parent's peak from before exec)
before = status("VmRSS:")
ckpt.load_into(target)
grown = status("VmHWM:") - before
ckpt.close()
ok = bool((target["w"] == 2.0).all()) and bool((target["v"] == 3.0).all())
print(grown, ok)
"""


def test_load_into_peak_rss_stays_near_the_model(tmp_path) -> None:
    """Peak RSS above the model during load_into, measured in a fresh process: no file buffer, no
    mapping of the shards, so far below the 1.1x-of-state bound (a mapped or buffered load adds 1x)."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak-RSS counter")
    n = 128 << 20  # 128 MiB of fp32 + 128 MiB of fp64
    state = {"w": torch.full((n // 4,), 2.0), "v": torch.full((n // 8,), 3.0, dtype=torch.float64)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(state, step=1).wait()
    del state
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    res = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(tmp_path), str(n)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    grown, ok = res.stdout.split()
    assert ok == "True"
    assert int(grown) <= 0.1 * nbytes, f"peak RSS grew by {int(grown) / nbytes:.2f}x of the state during load_into"


def _s3_config(proxied, url: str) -> CheckpointConfig:
    return CheckpointConfig(root=url, storage_options=proxied.storage_options, persist={"workers": 4},
                            network={"retries": 2, "backoff_s": 0.0})


def test_s3_piece_cut_mid_body_is_retried(s3_fault_proxy) -> None:
    """A ranged GET whose connection dies mid-body is retried; the load completes bit-exact."""
    url = s3_fault_proxy.fresh_url("cutread")
    state = {"w": torch.randn(PIECE_BYTES // 4 * 2 + 99)}  # three ranged GETs
    with Checkpointer(_s3_config(s3_fault_proxy, url)) as ckpt:
        ckpt.save(state, step=1).wait()
        s3_fault_proxy.proxy.cut_download_after(PIECE_BYTES // 2, then=Mode.PASS)  # a blip inside a piece
        got = ckpt.load()
        assert s3_fault_proxy.proxy.cut.is_set()
        assert torch.equal(got["w"], state["w"])
        assert ckpt.last_load_stats.tier == "remote" and ckpt.last_load_stats.method == "read"


def test_s3_piece_that_keeps_failing_is_raised_once_naming_the_file(s3_fault_proxy) -> None:
    url = s3_fault_proxy.fresh_url("deadread")
    state = {"w": torch.randn(PIECE_BYTES // 4 * 2 + 99)}
    with Checkpointer(_s3_config(s3_fault_proxy, url)) as ckpt:
        ckpt.save(state, step=1).wait()
        s3_fault_proxy.proxy.cut_download_after(PIECE_BYTES // 2, then=Mode.REFUSE)  # and the network stays down
        with pytest.raises(StorageError) as ei:
            ckpt.load()
        assert ".safetensors" in str(ei.value) and "step-000000001" in str(ei.value)
        s3_fault_proxy.proxy.pass_through()
        assert torch.equal(ckpt.load()["w"], state["w"])  # the checkpoint is intact, no error left pending
        ckpt.save(state, step=2).wait()  # and the failed load left nothing to raise at the next save


def test_the_nearest_tier_holding_the_step_serves_the_load(tmp_path) -> None:
    """Local before remote for the same committed step; the stats say which one served (shm: test_shm_load)."""
    import shutil

    state = {"w": torch.randn(1000), "step": 1}
    remote = f"memory://fastckpt-tiers-{uuid.uuid4().hex}"
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "local"), remote={"url": remote})) as ckpt:
        ckpt.save(state, step=1)
        ckpt.wait()  # committed locally and uploaded (a handle's wait() is the local commit only)
        assert_bit_equal(state, ckpt.load())
        assert ckpt.last_load_stats.tier == "local"
        shutil.rmtree(ckpt.list()[-1].path)  # the local copy is lost: the remote one is next
        assert_bit_equal(state, ckpt.load(step=1))
        assert ckpt.last_load_stats.tier == "remote" and ckpt.last_load_stats.method == "read"
        target = {"w": torch.zeros(1000), "step": 0}
        ckpt.load_into(target)
        assert torch.equal(target["w"], state["w"]) and ckpt.last_load_stats.tier == "remote"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the pinned buffer + copy stream path)")
def test_load_into_a_cuda_target_goes_through_pinned_buffers(tmp_path) -> None:
    state = {"w": torch.randn(PIECE_BYTES // 4 + 3), "h": torch.randn(64, 64).to(torch.bfloat16)}
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(state, step=1).wait()
        target = {k: torch.zeros_like(v, device="cuda") for k, v in state.items()}
        ptrs = {k: v.data_ptr() for k, v in target.items()}
        ckpt.load_into(target)
    for k, v in state.items():
        assert target[k].data_ptr() == ptrs[k] and torch.equal(target[k].cpu(), v), k
