"""Issue 53, the GPU half, checked without a GPU: the batched copies' bookkeeping (one call a shard and device, the
sources kept until their copies are seen done), the health figures taken "on the device" against the host's, and
``staging.device_snapshot``'s decisions and its config field. The copies themselves are faked (test_shm_cuda_staging's
``Dma``: bytes land only when the test lets them); the real-device counterparts are in test_cuda_batched_device.py.
"""
from __future__ import annotations

import gc
import json
import logging
import math
import threading
import weakref
from types import SimpleNamespace

import pytest
import torch

import fastckpt.engine.pipeline as pipeline_mod
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.errors import ConfigError, SnapshotMutatedError
from fastckpt.engine.cudacopy import device_batches, has_lazy_bits
from fastckpt.engine.devicesnap import DeviceSnapshots, fits, margin
from fastckpt.format.plan import TensorEntry
from tests.helpers import assert_bit_equal, clone_state
from tests.test_shm_cuda_staging import Dma, install

GIB = 1 << 30


class Counting(Dma):
    """``Dma`` that also counts the batched calls and what the device measured."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[int] = []  # sources per queue_copies call
        self.measured: list[int] = []  # sources measured per queue_stats call

    def copy(self, views, batch, stream) -> None:
        self.copies.append(len(batch.sources))
        super().copy(views, batch, stream)

    def stats(self, batch, stream):
        got = super().stats(batch, stream)
        self.measured.append(0 if got is None else len(got.positions))
        return got


def _config(root, **staging) -> CheckpointConfig:
    return CheckpointConfig(root=str(root), staging=staging, persist={"chunk_bytes": 64 * 1024, "fsync": False})


def _many() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"t{i:02d}": torch.randn(1000 + 37 * i, generator=g) for i in range(40)}


def test_a_shard_of_many_tensors_is_queued_in_one_call_per_device(tmp_path, monkeypatch) -> None:
    dma = Counting()
    install(monkeypatch, dma)
    dma.gate.set()
    state = _many()
    ref = clone_state(state)
    with Checkpointer(_config(tmp_path)) as ckpt:
        h = ckpt.save(state, step=1)
        h.wait(timeout=60)
        shards = len(ckpt.reader()._by_file())
        assert_bit_equal(ref, ckpt.load(step=1))
    # before: ten torch calls a tensor (record_stream, resolve_*, copy_ ...); now one _foreach_copy_ a shard
    assert len(dma.copies) == shards < len(state) and sum(dma.copies) == len(state), (dma.copies, shards)


def test_a_source_freed_by_the_caller_is_kept_until_its_copy_is_seen_done(tmp_path, monkeypatch) -> None:
    """In place of ``record_stream``: the caching allocator may reuse a freed source's memory only after its copy."""
    dma = Dma()
    install(monkeypatch, dma)
    with Checkpointer(_config(tmp_path)) as ckpt:
        tmp = torch.full((5000,), 1.5)
        ref = tmp.clone()
        gone = weakref.ref(tmp)
        h = ckpt.save({"t": tmp}, step=1)
        del tmp
        gc.collect()
        assert gone() is not None, "the source was dropped while its copy was still queued"
        dma.gate.set()  # the copy lands; the I/O worker sees its event done
        h.wait(timeout=60)
        gc.collect()
        assert gone() is None, "the source was kept after its copy was done"
        assert_bit_equal({"t": ref}, ckpt.load(step=1))


def test_device_batches_group_by_device_and_leave_cpu_and_empty_entries() -> None:
    def src(device: int):
        return SimpleNamespace(is_cuda=device >= 0, get_device=lambda: device)

    tensors = [src(1), src(-1), src(0), src(1), src(0)]
    entries = [TensorEntry(index=i, dtype=torch.float32, shape=(1,), lazy=False, offset=4 * i,
                           nbytes=0 if i == 4 else 4, shard=0) for i in range(5)]
    batches, on_cpu = device_batches(entries, tensors)
    assert [(b.device, b.positions, b.sources) for b in batches] == [(1, [0, 3], [tensors[0], tensors[3]]),
                                                                      (0, [2], [tensors[2]])]
    assert [e.index for e in on_cpu] == [1]
    with pytest.raises(ValueError, match="#2"):
        device_batches(entries, [tensors[0], tensors[1], None, tensors[3], tensors[4]])


def test_lazy_bits_are_read_without_asking_each_tensor() -> None:
    t = torch.randn(4, 4)
    z = torch.randn(4, dtype=torch.complex64)
    views = [t, t.t(), torch._neg_view(t), torch._neg_view(t).detach(), z.conj(), z.conj().imag, z.conj().real,
             torch._neg_view(torch._neg_view(t))]
    assert [has_lazy_bits(v) for v in views] == [v.is_conj() or v.is_neg() for v in views]


def _mixed() -> dict:
    g = torch.Generator().manual_seed(3)
    dirty = torch.randn(3000, generator=g)
    dirty[[5, 700, 2999]] = torch.tensor([math.nan, math.inf, -math.inf])
    return {"f32": torch.randn(5000, generator=g) * 3, "bf16": torch.randn(4097, generator=g).to(torch.bfloat16),
            "f16": torch.randn(333, generator=g).half(), "f64": torch.randn(1500, generator=g).double(),
            "dirty": dirty, "i64": torch.arange(777), "bool": torch.rand(99, generator=g) > 0.5,
            "c64": torch.randn(50, dtype=torch.complex64, generator=g), "zero": torch.empty(0, 3),
            "scalar": torch.tensor(-2.5), "huge64": torch.full((7,), 1e200, dtype=torch.float64)}


def test_health_figures_measured_on_the_device_are_the_hosts(tmp_path, monkeypatch) -> None:
    state = _mixed()
    with Checkpointer(_config(tmp_path / "host")) as ckpt:  # the CPU path: the host's pass measures
        ckpt.save(clone_state(state), step=1).wait(timeout=60)
    host = json.loads((tmp_path / "host" / "step-000000001" / "manifest.json").read_text())["health"]["tensors"]
    dma = Counting()
    install(monkeypatch, dma)
    dma.gate.set()
    with Checkpointer(_config(tmp_path / "dev")) as ckpt:
        ckpt.save(state, step=1).wait(timeout=60)
        assert_bit_equal(state, ckpt.load(step=1))
    dev = json.loads((tmp_path / "dev" / "step-000000001" / "manifest.json").read_text())["health"]["tensors"]
    # the float tensors with elements were measured "on the device" (the NaN/Inf and overflowing ones too, then
    # measured again on the host); integers, bool, complex and the empty one only on the host
    assert sum(dma.measured) == 7, dma.measured
    assert set(dev) == set(host)
    for key, want in host.items():
        got = dev[key]
        assert {k: got[k] for k in ("n", "nan", "inf", "absmax", "fp")} == \
            {k: want[k] for k in ("n", "nan", "inf", "absmax", "fp")}, key
        if want["l2"] is None or not want["l2"]:
            assert got["l2"] == want["l2"], key
        else:  # docs/FORMAT.md: l2 within 1e-6 relative (summed in another order on the device)
            assert abs(got["l2"] - want["l2"]) <= 1e-6 * want["l2"], (key, got["l2"], want["l2"])
    assert dev["dirty"]["nan"] == 1 and dev["dirty"]["inf"] == 2 and dev["huge64"]["l2"] is None


# ---- staging.device_snapshot -----------------------------------------------------------------------------------

def test_device_snapshot_is_a_validated_config_field() -> None:
    assert CheckpointConfig(root="/tmp/x").staging.device_snapshot == "off"
    for mode in ("auto", "on", "off"):
        assert CheckpointConfig(root="/tmp/x", staging={"device_snapshot": mode}).staging.device_snapshot == mode
    with pytest.raises(ConfigError, match=r"staging\.device_snapshot must be one of auto, on, off; got 'yes'"):
        CheckpointConfig(root="/tmp/x", staging={"device_snapshot": "yes"})
    cfg = CheckpointConfig(root="/tmp/x")
    with pytest.raises(ConfigError, match="staging.device_snapshot"):
        cfg.staging.device_snapshot = True  # type: ignore[assignment]
    assert cfg.staging.device_snapshot == "off"


@pytest.mark.parametrize("mode, need, free, total, want", [
    ("auto", 2 * GIB, 80 * GIB, 80 * GIB, True),
    ("auto", 2 * GIB, 9 * GIB, 80 * GIB, False),  # 7 GiB left beside a margin of 8
    ("auto", 2 * GIB, 11 * GIB, 80 * GIB, True),
    ("auto", 0, 7 * GIB, 80 * GIB, False),  # made already, but the training now needs the room
    ("auto", 1 * GIB, 2 * GIB, 4 * GIB, True),  # a small device: the margin is 1 GiB
    ("auto", 1 * GIB, GIB + GIB // 2, 4 * GIB, False),
    ("on", 2 * GIB, 0, 80 * GIB, True),  # on: the allocation decides
    ("off", 0, 80 * GIB, 80 * GIB, False),
])
def test_auto_decides_from_the_free_device_memory(mode, need, free, total, want) -> None:
    assert margin(80 * GIB) == 8 * GIB and margin(4 * GIB) == GIB
    assert fits(mode, need, free, total) is want


class _Tensor:
    """What ``DeviceSnapshots.take`` reads of a CUDA tensor before it allocates anything."""

    def __init__(self, nbytes: int, device: int = 0) -> None:
        self.is_cuda, self._n, self._d = True, nbytes, device

    def get_device(self) -> int:
        return self._d

    def numel(self) -> int:
        return self._n

    def element_size(self) -> int:
        return 1


def test_auto_without_room_stages_the_live_tensors_and_says_so_once(caplog) -> None:
    asked = []

    def mem_info(device: int) -> tuple[int, int]:
        asked.append(device)
        return 3 * GIB, 16 * GIB  # margin 1.6 GiB: 2 GiB of state leaves too little

    snaps = DeviceSnapshots("auto", mem_info)
    state = [_Tensor(2 * GIB), None]
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        assert snaps.take(state, [0]) is None
        assert snaps.take(state, [0]) is None
    assert asked == [0, 0], "auto must ask the device at every save"
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "cuda:0 has 3072 MiB free" in said[0] and "staging.device_snapshot: auto" in said[0]
    assert DeviceSnapshots("off", mem_info).take(state, [0]) is None and asked == [0, 0]


def test_a_snapshot_still_being_queued_is_not_overwritten() -> None:
    """The next save stages from the live tensors while the previous snapshot's copies are not all queued."""
    snaps = DeviceSnapshots("on", lambda d: (0, 0))
    snaps.used_by(SimpleNamespace(handle=SimpleNamespace(staged=lambda: False), shard_events={}))
    assert snaps.take([_Tensor(10)], [0]) is None


def test_a_snapshot_save_is_neither_sealed_nor_waited_for(tmp_path, monkeypatch) -> None:
    """With a device snapshot the copies read save()'s copy of the state: a write after save() (refused without a
    snapshot) reaches neither the checkpoint nor the seal, and no stream of the caller's is ordered after them."""
    dma = Dma()
    install(monkeypatch, dma)
    seen = []

    def take(self, tensors, devices):  # the device copy, as of save() (fake: on the CPU)
        seen.append(self._last)
        return [t.clone() if t is not None else None for t in tensors]

    monkeypatch.setattr(DeviceSnapshots, "take", take)
    hold = threading.Event()  # the copy thread queues the lazy copies only once the write below is done
    real = pipeline_mod.Pipeline._copy_into

    def held(*args, **kwargs):
        if threading.current_thread().name.startswith("fastckpt-copy") and not hold.wait(timeout=60):
            raise TimeoutError("test gate never opened")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod.Pipeline, "_copy_into", held)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(_config(tmp_path, device_snapshot="on")) as ckpt:
        ckpt.watch(opt)
        state = {"m": model.state_dict()}
        ref = clone_state(state)
        h = ckpt.save(state, step=1)
        with torch.no_grad():
            model.weight.add_(1)  # before the lazy copies are queued: the version counter moves
        hold.set()
        dma.gate.set()
        h.wait(timeout=60)
        assert h.stats.device_snapshot and h.stats.gpu_waits == 0 and h._cuda_events == []
        assert_bit_equal(ref, ckpt.load(step=1))
        h2 = ckpt.save(state, step=2)
        h2.wait(timeout=60)
        assert seen[0] is None and seen[1].handle is h, "the next snapshot must know whose copies read the buffer"
    # the same write without a snapshot: refused at the seal, as before
    dma.gate.clear()
    monkeypatch.undo()
    dma = Dma()
    install(monkeypatch, dma)
    with Checkpointer(_config(tmp_path / "live")) as ckpt:
        ckpt.watch(opt)
        h = ckpt.save({"m": model.state_dict()}, step=1)
        with torch.no_grad():
            model.weight.add_(1)
        dma.gate.set()
        with pytest.raises(SnapshotMutatedError, match="m/weight"):
            h.wait(timeout=60)
