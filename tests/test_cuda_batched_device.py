"""Issue 53, the GPU half, on a real device: the batched copies (engine/cudacopy.py), the health figures reduced on the
device (engine/devicehealth.py) and ``staging.device_snapshot`` (engine/devicesnap.py).

As in test_cuda.py, each race widens its window with ``torch.cuda._sleep`` on the stream whose work must come
first and never synchronizes before ``save()``, so a missing wait fails the bit-for-bit comparison instead of being
hidden by timing. They need a CUDA device and skip without one; their logic is checked without a GPU in
test_cuda_batched.py.
"""
from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer
from tests.helpers import assert_bit_equal, clone_state
from tests.test_cuda import _setup, _step  # the same small model and step as the CUDA path's own tests

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

SLEEP = 1_000_000_000  # GPU clock cycles: some hundreds of milliseconds, far longer than any copy below
_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def _host(obj):
    """The values of ``obj``'s tensors (conj/neg views resolved) as plain CPU tensors."""
    if isinstance(obj, dict):
        return {k: _host(v) for k, v in obj.items()}
    return obj.detach().resolve_conj().resolve_neg().cpu().clone() if isinstance(obj, torch.Tensor) else obj


def _busy(stream: torch.cuda.Stream | None = None) -> None:
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        torch.cuda._sleep(SLEEP)


def _awkward(device: str = "cuda") -> dict:
    """Mixed dtypes, non-contiguous, expanded, conjugate and negative views, a zero-size tensor and a CPU one."""
    g = torch.Generator(device=device).manual_seed(0)
    base = torch.randn(256, 128, device=device, generator=g)
    z = torch.randn(4096, dtype=torch.complex64, device=device, generator=g)
    return {
        "f32": base, "bf16": base.to(torch.bfloat16), "f16": base[:100].half(), "f64": base[:50].double(),
        "fp8": base.to(torch.float8_e4m3fn), "i64": torch.arange(1000, device=device), "bool": base[0] > 0,
        "transposed": base.t(), "strided": base[::3, 1::2], "expanded": base[:3, :1].expand(3, 40),
        "conj": z.conj(), "neg": torch._neg_view(base[:7]), "imag_of_conj": z.conj().imag,
        "zero": torch.empty(0, 5, device=device), "scalar": torch.tensor(3.5, device=device),
        "cpu": torch.randn(1000),
    }


@pytest.mark.parametrize("snapshot", ["off", "on"])
@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_awkward_tensors_restore_bit_exact_through_the_batched_copies(tmp_path, mode, snapshot) -> None:
    state = _awkward()
    ref = _host(state)
    cfg = CheckpointConfig(root=str(tmp_path), staging={"mode": mode, "device_snapshot": snapshot},
                           persist={"chunk_bytes": 64 * 1024})  # several shards
    with Checkpointer(cfg) as ckpt:
        _busy(ckpt._streams.eager(0))
        _busy(ckpt._streams.lazy(0))  # the copies queue behind these: a host-side fix-up would race the DMA
        h = ckpt.save(state, step=1, lazy=list(state.values()) if mode == "lazy" else ())
        h.wait(timeout=120)
        assert h.stats.device_snapshot is (snapshot == "on")
        assert_bit_equal(ref, ckpt.load(step=1))


@_two_gpus
def test_two_devices_in_one_shard(tmp_path) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(3000, generator=g).to("cuda:0"), "b": torch.randn(3000, generator=g).to("cuda:1"),
             "c": torch.randn(40, 50, generator=g).half().to("cuda:1").t(), "d": torch.randn(7, generator=g)}
    ref = _host(state)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:  # one 128 MiB shard holds all three
        with torch.cuda.device(1):
            _busy()
        h = ckpt.save(state, step=1)
        h.wait(timeout=120)
        assert len(ckpt.reader()._by_file()) == 1
        assert_bit_equal(ref, ckpt.load(step=1))


def test_a_lazy_source_freed_right_after_save_is_not_reused_before_its_copy(tmp_path) -> None:
    """What record_stream guaranteed: the save keeps a source until its copy is seen done, so the caching allocator
    cannot hand its block to a new tensor that a stream not ordered after the copy fills meanwhile. The seal drops
    the save's other references (wait_staged, with a side stream current: only that one is ordered after the
    copies); the default stream's next allocation of that size is the freed block, filled at once."""
    n = 1 << 22  # 16 MiB
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save({"warm": torch.zeros(1, device="cuda")}, step=0).wait(timeout=60)  # makes the copy streams
        side = torch.cuda.Stream()
        tmp = torch.full((n,), 1.5, device="cuda")
        ref = tmp.cpu()  # synchronizes: nothing queued is left before the save
        _busy(ckpt._streams.lazy(0))  # the lazy copy runs long after the fill below
        h = ckpt.save({"t": tmp}, step=1, lazy=[tmp])
        del tmp
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            h.wait_staged()  # sealed: the guard's and the seal's references are dropped
        junk = torch.full((n,), -7.0, device="cuda")  # the default stream does not wait for the copy
        h.wait(timeout=120)
        assert_bit_equal({"t": ref}, ckpt.load(step=1))
        assert junk[0].item() == -7.0


@pytest.mark.parametrize("snapshot", ["on", "auto"])
def test_a_device_snapshot_lets_the_step_run_while_the_copies_wait(tmp_path, snapshot) -> None:
    """The copies to the host read the snapshot: the steps after save() neither wait for them on the GPU (no
    gpu_waits, no events to order after) nor reach the checkpoint, which holds the values at save()."""
    model, opt, x = _setup()
    _step(model, opt, x)
    with Checkpointer(CheckpointConfig(root=str(tmp_path), staging={"device_snapshot": snapshot})) as ckpt:
        ckpt.watch(opt)
        for step in (1, 2):  # the second save reuses the buffer
            state = {"m": model.state_dict(), "o": opt.state_dict()}
            ref = clone_state(state)  # queued on the training stream, before save()
            _busy(ckpt._streams.lazy(0))
            h = ckpt.save(state, step=step)
            for _ in range(3):
                _step(model, opt, x)  # writes the parameters while the copies still wait behind the sleep
            assert h.stats.device_snapshot, f"{snapshot}: no snapshot on a device with room"
            assert h.stats.gpu_waits == 0 and h._cuda_events == [], "the step waited for the snapshot's copies"
            h.wait(timeout=120)
            assert_bit_equal(_host(ref), ckpt.load(step=step))
        buffers = ckpt._streams.snapshots._buffers
        assert list(buffers) == [0] and buffers[0].data.is_cuda


def test_an_oom_on_the_snapshot_falls_back_to_the_live_tensors(tmp_path, caplog) -> None:
    """A real out-of-memory error of torch's allocator (a per-process cap that leaves room for half the snapshot):
    the saves go on from the live tensors, said once, without asking the allocator again, and restore bit for bit."""
    state = {"w": torch.randn(1 << 24, device="cuda"), "b": torch.randn(1000, device="cuda")}  # 64 MiB
    ref = _host(state)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(0) + (32 << 20)) / total, 0)
    try:
        with Checkpointer(CheckpointConfig(root=str(tmp_path), staging={"device_snapshot": "on"})) as ckpt:
            with caplog.at_level("WARNING", logger="fastckpt"):
                handles = [ckpt.save(state, step=s) for s in (1, 2)]
                for h in handles:
                    h.wait(timeout=120)
            assert [h.stats.device_snapshot for h in handles] == [False, False]
            said = [r.getMessage() for r in caplog.records if "no snapshot" in r.getMessage()]
            assert len(said) == 1 and "staging.device_snapshot" in said[0], said
            assert ckpt._streams.snapshots._refused == {0: state["w"].numel() * 4 + 4096}
            for s in (1, 2):
                assert_bit_equal(ref, ckpt.load(step=s))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)


def test_auto_leaves_the_margin_to_training(tmp_path, monkeypatch) -> None:
    """auto asks the device: with less free memory than the snapshot plus the margin it stages the live tensors."""
    model, opt, x = _setup()
    _step(model, opt, x)
    free, total = torch.cuda.mem_get_info(0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (total // 20, total))  # under the 10% margin
    with Checkpointer(CheckpointConfig(root=str(tmp_path), staging={"device_snapshot": "auto"})) as ckpt:
        ckpt.watch(opt)
        h = ckpt.save({"m": model.state_dict()}, step=1)
        h.wait(timeout=120)
        assert not h.stats.device_snapshot and ckpt._streams.snapshots._buffers == {}


def test_health_figures_of_the_device_equal_the_hosts(tmp_path) -> None:
    g = torch.Generator(device="cuda").manual_seed(5)
    dirty = torch.randn(70000, device="cuda", generator=g)
    dirty[[3, 4000, 69999]] = torch.tensor([math.nan, math.inf, -math.inf], device="cuda")
    state = {"f32": torch.randn(300000, device="cuda", generator=g) * 7, "dirty": dirty,
             "bf16": torch.randn(123457, device="cuda", generator=g).to(torch.bfloat16),
             "f16": torch.randn(999, device="cuda", generator=g).half(),
             "f64": torch.randn(5000, device="cuda", generator=g).double(), "neg": torch._neg_view(dirty[:1000]),
             "strided": torch.randn(600, 400, device="cuda", generator=g)[::2, ::3],
             "i64": torch.arange(5000, device="cuda"), "huge64": torch.full((9,), 1e200, device="cuda",
                                                                             dtype=torch.float64)}
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "gpu"))) as ckpt:
        ckpt.save(state, step=1).wait(timeout=120)
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "cpu"))) as ckpt:
        ckpt.save(_host(state), step=1).wait(timeout=120)  # the host's pass measures the same values
    dev, host = (json.loads((tmp_path / w / "step-000000001" / "manifest.json").read_text())["health"]["tensors"]
                 for w in ("gpu", "cpu"))
    assert set(dev) == set(host)
    for key, want in host.items():
        got = dev[key]
        assert {k: got[k] for k in ("n", "nan", "inf", "absmax", "fp")} == \
            {k: want[k] for k in ("n", "nan", "inf", "absmax", "fp")}, key
        if want["l2"] is None or not want["l2"]:
            assert got["l2"] == want["l2"], key
        else:  # docs/FORMAT.md: within 1e-6 relative
            assert abs(got["l2"] - want["l2"]) <= 1e-6 * want["l2"], (key, got["l2"], want["l2"])
    assert dev["dirty"]["nan"] == 1 and dev["dirty"]["inf"] == 2 and dev["huge64"]["l2"] is None
