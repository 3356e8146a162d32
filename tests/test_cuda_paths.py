"""Issue 24's CUDA findings, checked without a GPU: a Lightning resume of CUDA-tagged storages, load_into's
per-device side streams, waits and failures that must not leave a save pending, the pinned buffers' device guard
and error reset, and the ``cuda`` marker itself. The real-device counterparts are in test_cuda_device.py."""
from __future__ import annotations

import ast
import re
import threading
from pathlib import Path

import pytest
import torch

import fastckpt.engine.cudastage as cudastage_mod
import fastckpt.engine.pipeline as pipeline_mod
import fastckpt.engine.saver as saver_mod
import fastckpt.engine.pinned as pinned_mod
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.engine.handle import SaveHandle, SaveStats
from fastckpt.errors import FastCkptError
import fastckpt.cudart as cudart_mod
import fastckpt.read.devicecopy as devicecopy_mod
import fastckpt.read.loader as loader_mod
from fastckpt.read.devicecopy import DeviceCopies
from fastckpt.read.load_into import _Targets
from fastckpt.read.readers import Range
from tests.helpers import assert_bit_equal, bounded
from tests.test_cuda_logic import FakeCuda, FakeEvent, FakeStream

TESTS = Path(__file__).parent


# ---- Lightning: a resume keeps CUDA-saved storages on the CPU ------------------------------------------------

def _cuda_tagged_ckpt(path: Path, state: dict) -> None:
    """A torch checkpoint file whose storages say they were saved from ``cuda:0`` (as a GPU run writes it)."""
    real = torch.serialization.location_tag
    torch.serialization.location_tag = lambda storage: "cuda:0"  # read by torch.save's persistent_id
    try:
        torch.save(state, path)
    finally:
        torch.serialization.location_tag = real
    assert b"cuda:0" in path.read_bytes()


@pytest.mark.parametrize("via", ["reader", "plugin"])
def test_lightning_resume_keeps_cuda_saved_storages_on_the_cpu(tmp_path, via) -> None:
    from fastckpt_lightning import FastCheckpointIO
    from fastckpt_lightning.reader import read_checkpoint

    torch.manual_seed(0)
    state = {"state_dict": {"w": torch.randn(64, 8), "b": torch.arange(5)}, "epoch": 1}
    path = tmp_path / "epoch=0-step=1.ckpt"
    _cuda_tagged_ckpt(path, state)
    if via == "reader":
        loaded = read_checkpoint(str(path))
    else:
        plugin = FastCheckpointIO()
        try:
            loaded = plugin.load_checkpoint(str(path))  # the Trainer's call on resume: map_location=None
        finally:
            plugin.teardown()
    # torch's default would restore them on cuda:0: a CPU-only machine raises, and every DDP rank fills GPU 0
    assert {t.device.type for t in loaded["state_dict"].values()} == {"cpu"}
    assert_bit_equal(state, loaded)


# ---- load_into: one side stream per device, ordered after the caller's stream ---------------------------------

class _Stream(FakeStream):
    def __init__(self, device=None, priority=0) -> None:
        super().__init__(device, priority)
        self.waited_streams: list = []

    def wait_stream(self, other) -> None:
        self.waited_streams.append(other)


class _CudaTarget:
    """A CPU tensor posing as a CUDA target of ``device``: records the device and stream each copy ran under."""

    def __init__(self, t: torch.Tensor, device: int) -> None:
        self.t, self.device, self.is_cuda, self.copied_under = t, torch.device("cuda", device), True, None

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> None:
        self.copied_under = (FakeCuda.current, _current[0], non_blocking)
        self.t.copy_(src)


_current: list = [None]  # the fake "current stream" of torch.cuda.stream(...)


class _stream_ctx:
    def __init__(self, s) -> None:
        self.s = s

    def __enter__(self) -> None:
        self.prev, _current[0] = _current[0], self.s

    def __exit__(self, *exc) -> None:
        _current[0] = self.prev


def _fake_streams(monkeypatch) -> FakeCuda:
    fake = FakeCuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", _stream_ctx)
    for d in fake.current_streams:
        fake.current_streams[d] = _Stream(d)
    return fake


def test_load_into_copies_on_each_devices_own_stream_after_the_callers(monkeypatch) -> None:
    fake = _fake_streams(monkeypatch)
    targets = _Targets(DeviceCopies(streams=_Stream))
    dsts = {d: _CudaTarget(torch.zeros(4), d) for d in (0, 1)}
    for d, dst in dsts.items():
        targets.buffered.append(("f", None, dst, None))  # type: ignore[arg-type]
    targets.prepare_cuda()
    streams = targets.device.streams
    assert sorted(streams) == [0, 1], "one side stream per device of the targets"
    for d, s in streams.items():
        assert s.device == d
        # ordered after the caller's current stream of that device: the lazy copies load_into waited for there
        assert s.waited_streams == [fake.current_streams[d]]
    for d, dst in dsts.items():
        r = Range("f", 0, memoryview(bytearray(16)), None, "")
        targets.copies[id(r)] = (torch.full((4,), float(d + 1)), dst)  # type: ignore[assignment]
        targets.done(r)
        assert dst.copied_under == (d, streams[d], True), "copy on its own device's side stream"
        assert torch.equal(dst.t, torch.full((4,), float(d + 1)))
    assert len(targets.device.held) == 2, "the pinned buffers live until their copies are done"
    targets.drain()
    assert targets.device.held == []
    targets.finish()
    for d, s in streams.items():  # the caller's next kernels come after the loaded values
        assert fake.current_streams[d].waited_streams == [s]


def test_load_side_streams_are_fastckpts_own_one_per_device_for_the_process(monkeypatch) -> None:
    # torch.cuda.Stream() hands out the pool's 32 streams per device, which NCCL and FSDP2 take theirs from: a
    # load's copies must not queue behind a collective. The side streams come from torch's runtime instead.
    from tests.test_copy_streams import FakeExternalStream, FakeRuntime

    _fake_streams(monkeypatch)
    lib = FakeRuntime()
    monkeypatch.setattr(cudart_mod, "loaded_cudart", lambda: lib)
    monkeypatch.setattr(torch.cuda, "ExternalStream", FakeExternalStream)
    monkeypatch.setattr(devicecopy_mod, "_streams", {})

    def pool(*args, **kwargs):
        raise AssertionError("a load side stream was taken from torch's pool")

    monkeypatch.setattr(torch.cuda, "Stream", pool)
    FakeExternalStream.wait_stream = lambda self, other: None  # type: ignore[attr-defined]
    try:
        for _ in range(2):  # two loads
            targets = _Targets()
            for d in (0, 1):
                targets.buffered.append(("f", None, _CudaTarget(torch.zeros(4), d), None))  # type: ignore[arg-type]
            targets.prepare_cuda()
            assert [(s.cuda_stream, s.device.index) for s in targets.device.streams.values()] == \
                [(h, d) for h, d, _, _ in lib.created]
    finally:
        del FakeExternalStream.wait_stream  # type: ignore[attr-defined]
    assert [(d, flags, prio) for _, d, flags, prio in lib.created] == [(0, 1, 0), (1, 1, 0)], (
        "one non-blocking stream per device, made under its device, for the whole process")


def test_a_pageable_source_is_staged_and_the_held_bytes_stay_bounded(monkeypatch) -> None:
    fake = _fake_streams(monkeypatch)
    staged: list[torch.Tensor] = []

    def pinned(src: torch.Tensor) -> torch.Tensor:
        staged.append(src.clone())
        return staged[-1]

    monkeypatch.setattr(devicecopy_mod, "pinned_copy", pinned)
    copies = DeviceCopies(budget=3 * 16, streams=_Stream)
    copies.prepare([1])
    dst = _CudaTarget(torch.zeros(4), 1)
    for i in range(4):
        src = torch.full((4,), float(i))  # pageable: a read buffer's view, let go right after
        copies.copy(dst, src)  # type: ignore[arg-type]
        assert staged[-1] is not src and torch.equal(staged[-1], src)
        assert dst.copied_under == (1, copies.streams[1], True) and torch.equal(dst.t, src)
    # 4 sources of 16 bytes over a budget of 48: the fourth waited for the copies, and the sources went
    assert copies.held == [] and copies.held_bytes == 0
    cpu = torch.zeros(4)
    copies.copy(cpu, torch.ones(4))  # a CPU target: copied at once, nothing staged or held
    assert torch.equal(cpu, torch.ones(4)) and len(staged) == 4 and copies.held == []
    copies.finish()
    assert fake.current_streams[1].waited_streams == [copies.streams[1]]


def test_dtensor_load_into_copies_through_the_side_streams_between_prepare_and_finish(tmp_path, monkeypatch) -> None:
    # The distributed/DTensor path of load_into (an FSDP2 resume) copies regions on the load worker threads: every
    # copy goes through DeviceCopies, prepared on the caller's thread before the first, drained and finished there
    # after the last, a failed load included.
    from tests.dist_launcher import run_ranks

    run_ranks(_save_dtensors, 1, str(tmp_path))
    events: list[tuple[str, str]] = []

    class Recording(DeviceCopies):
        def prepare(self, devices):
            events.append(("prepare", threading.current_thread().name))
            super().prepare(devices)

        def copy(self, dst, src, pinned=False):
            events.append(("copy", threading.current_thread().name))
            super().copy(dst, src, pinned)

        def drain(self):
            events.append(("drain", threading.current_thread().name))
            super().drain()

        def finish(self):
            events.append(("finish", threading.current_thread().name))
            super().finish()

    monkeypatch.setattr(loader_mod, "DeviceCopies", Recording)
    ref = _dtensor_state()
    me = threading.current_thread().name
    with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"workers": 4})) as ckpt:
        target = {k: torch.full_like(v, -1.0) for k, v in ref.items()}
        ckpt.load_into(target, step=1)
        assert_bit_equal(ref, target)
        kinds = [k for k, _ in events]
        assert kinds[0] == "prepare" and kinds[-2:] == ["drain", "finish"] and kinds.count("copy") >= 4
        assert all(t == me for k, t in events if k != "copy"), events
        assert {t for k, t in events if k == "copy"} - {me}, "the copies run on the load worker threads"
        events.clear()
        block = next(p for p in (tmp_path / "step-000000001").iterdir() if p.name.startswith("shard-"))
        data = bytearray(block.read_bytes())
        data[-1] ^= 0xFF
        block.write_bytes(bytes(data))
        with pytest.raises(FastCkptError):
            ckpt.load_into(target, step=1)
        assert [k for k, _ in events][-2:] == ["drain", "finish"], "a failed load must still let the copies land"


def _dtensor_state() -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.arange(1024.0 * (i + 1)).reshape(32 * (i + 1), 32) for i in range(4)}  # 4+ KiB each


def _save_dtensors(rank: int, world: int, root: str) -> None:
    """A checkpoint of DTensors (a 1-rank mesh), one file each: what an FSDP2 save writes, blocks and all."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in _dtensor_state().items()}
    with Checkpointer(CheckpointConfig(root=root, persist={"chunk_bytes": 4096})) as ckpt:
        ckpt.save(state, step=1).wait()


# ---- waits and failures must not leave a save pending ----------------------------------------------------------

def test_a_failed_gpu_side_wait_fails_the_save_and_frees_its_slot(tmp_path, monkeypatch) -> None:
    cfg = CheckpointConfig(root=str(tmp_path), staging={"slots": 1, "when_busy": "skip"})
    state = {"w": torch.randn(100)}
    ckpt = Checkpointer(cfg)
    real_stage = ckpt._saver.pipeline.stage_now

    def stage_with_a_copy_event(job, shards):  # bookkeeping only: as if a CUDA copy had been queued
        real_stage(job, shards)
        job.shard_events[(0, 0)] = FakeEvent()

    def cuda_error(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with monkeypatch.context() as m:
        m.setattr(ckpt._saver.pipeline, "stage_now", stage_with_a_copy_event)
        m.setattr(saver_mod, "gpu_wait", cuda_error)
        m.setattr(cudastage_mod, "host_wait", cuda_error)  # the committer's wait for the copies fails too
        with pytest.raises(FastCkptError, match="staging checkpoint 'step-000000001' failed") as err:
            ckpt.save(state, step=1)
        assert isinstance(err.value.__cause__, RuntimeError)
        bounded(lambda: ckpt.wait(timeout=30), 60)  # the committer failed the handle (it died, and this hung)
        assert ckpt.pending_names() == []
    h = ckpt.save(state, step=2)
    assert not h.skipped, "the failed save left its staging slot busy"
    h.wait(timeout=60)
    assert_bit_equal(state, ckpt.load(step=2))
    bounded(ckpt.close, 60)  # hung while the first save stayed pending


def test_waits_on_cuda_copies_are_counted(monkeypatch) -> None:
    FakeCuda(monkeypatch)
    h = SaveHandle(name="x", step=1, path="p", stats=SaveStats(step=1, name="x"))
    h._staged.set()
    running = FakeEvent()
    h._cuda_events = [(0, running)]
    h.wait_staged()  # GPU-side: the next kernels wait, the host does not
    assert h.stats.gpu_waits == 1 and h.stats.waited_ms == 0.0
    h.wait_staged(host=True)
    assert running.done and h.stats.waited_ms > 0.0, "a host wait on the copies is a stall too"
    h.wait_staged()
    assert h.stats.gpu_waits == 1, "nothing left to wait for"
    assert h.stats.as_dict()["gpu_waits"] == 1.0


# ---- pinned buffers: device guard at unregistration, CUDA's last error reset on a failed registration ---------

class _Cudart:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.unregistered_on = fail, []

    def cudaHostRegister(self, ptr, size, flags):
        return 2 if self.fail else 0  # cudaErrorMemoryAllocation

    def cudaHostUnregister(self, ptr):
        self.unregistered_on.append(FakeCuda.current)
        return 0


def _pin(monkeypatch, cudart) -> pinned_mod.Pinned:
    import mmap
    FakeCuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: FakeCuda.current)
    mm = mmap.mmap(-1, 4096)
    with torch.cuda.device(1):  # save() selects the state's device while it acquires a slot
        return pinned_mod.Pinned(mm, torch.frombuffer(mm, dtype=torch.uint8), "test memory")


def test_pinned_memory_is_unregistered_under_its_own_device(monkeypatch) -> None:
    cudart = _Cudart()
    pinned = _pin(monkeypatch, cudart)
    FakeCuda.current = -1  # close() or the collector, on a thread with no device selected
    pinned.release()
    assert cudart.unregistered_on == [1], "unregistering outside its device opens a context on GPU 0"


def test_a_failed_registration_resets_cudas_last_error(monkeypatch) -> None:
    cleared = []
    monkeypatch.setattr(pinned_mod, "clear_last_cuda_error", lambda: cleared.append(True))
    with pytest.raises(FastCkptError, match=r"cannot page-lock 4096 bytes of test memory .*cudaHostRegister error 2"):
        _pin(monkeypatch, _Cudart(fail=True))
    assert cleared == [True], "the next kernel launch check would raise the registration's error"


def test_clearing_cudas_last_error_without_a_runtime_loaded_is_a_no_op() -> None:
    if "libcudart" in Path("/proc/self/maps").read_text():
        pytest.skip("a CUDA runtime is loaded here: test_cuda_device.py covers the real reset")
    pinned_mod.clear_last_cuda_error()


# ---- the cuda marker cannot rot ------------------------------------------------------------------------------

# What makes a test need a GPU: a tensor or module put on a CUDA device, or a skip on the device's presence.
_USES_CUDA = re.compile(r"""device=["']cuda|\.cuda\(|\.to\(["']cuda|torch\.device\(["']cuda|torch\.cuda\.is_available\(\)"""
                        r"""|torch\.cuda\.device_count\(\)|accelerator=["']gpu""")


def _marked_cuda(decorators: list[ast.expr]) -> bool:
    return any("mark.cuda" in ast.unparse(d) for d in decorators)


def _module_marked(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            return "mark.cuda" in ast.unparse(node.value)
    return False


def _cuda_tests() -> list[tuple[str, str, bool, bool]]:
    """(file, test, uses CUDA, marked cuda) for every test function of tests/."""
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_marked = _module_marked(tree)
        module_text = "\n".join(ast.unparse(n) for n in tree.body if isinstance(n, ast.Assign))
        module_uses = bool(_USES_CUDA.search(module_text)) and "pytestmark" in module_text
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_"):
                uses = module_uses or bool(_USES_CUDA.search(ast.unparse(node)))
                found.append((path.name, node.name, uses, module_marked or _marked_cuda(node.decorator_list)))
    return found


def test_every_cuda_test_carries_the_cuda_marker() -> None:
    tests = _cuda_tests()
    unmarked = [f"{f}::{t}" for f, t, uses, marked in tests if uses and not marked]
    assert not unmarked, f"tests that need a GPU without @pytest.mark.cuda (pytest -m cuda misses them): {unmarked}"
    assert any(uses for _, _, uses, _ in tests), "the check found no CUDA test at all: its pattern is broken"


def test_only_cuda_tests_carry_the_cuda_marker() -> None:
    wrong = [f"{f}::{t}" for f, t, uses, marked in _cuda_tests() if marked and not uses]
    assert not wrong, f"CPU tests marked cuda (pytest -m 'not cuda' would skip them): {wrong}"


def test_the_marker_check_sees_an_unmarked_cuda_test() -> None:
    src = "def test_x():\n    t = torch.ones(3, device=" + "'cuda')\n"  # split: this test itself needs no GPU
    node = ast.parse(src).body[0]
    assert isinstance(node, ast.FunctionDef)
    assert _USES_CUDA.search(ast.unparse(node)) and not _marked_cuda(node.decorator_list)
    marked = ast.parse("@pytest.mark.cuda\n" + src).body[0]
    assert isinstance(marked, ast.FunctionDef) and _marked_cuda(marked.decorator_list)
