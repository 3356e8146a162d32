"""Issue 24's CUDA findings, checked without a GPU: a Lightning resume of CUDA-tagged storages, load_into's
per-device side streams, waits and failures that must not leave a save pending, the pinned buffers' device guard
and error reset, and the ``cuda`` marker itself. The real-device counterparts are in test_cuda_device.py."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import fastckpt.engine.pipeline as pipeline_mod
import fastckpt.engine.saver as saver_mod
import fastckpt.engine.pinned as pinned_mod
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.engine.handle import SaveHandle, SaveStats
from fastckpt.errors import FastCkptError
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


def test_load_into_copies_on_each_devices_own_stream_after_the_callers(monkeypatch) -> None:
    fake = FakeCuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", _stream_ctx)
    for d in fake.current_streams:
        fake.current_streams[d] = _Stream(d)
    targets = _Targets()
    dsts = {d: _CudaTarget(torch.zeros(4), d) for d in (0, 1)}
    for d, dst in dsts.items():
        targets.buffered.append(("f", None, dst, None))  # type: ignore[arg-type]
    targets.prepare_cuda()
    assert sorted(targets.streams) == [0, 1], "one side stream per device of the targets"
    for d, s in targets.streams.items():
        assert s.device == d
        # ordered after the caller's current stream of that device: the lazy copies load_into waited for there
        assert s.waited_streams == [fake.current_streams[d]]
    for d, dst in dsts.items():
        r = Range("f", 0, memoryview(bytearray(16)), None, "")
        targets.copies[id(r)] = (torch.full((4,), float(d + 1)), dst)  # type: ignore[assignment]
        targets.done(r)
        assert dst.copied_under == (d, targets.streams[d], True), "copy on its own device's side stream"
        assert torch.equal(dst.t, torch.full((4,), float(d + 1)))
    assert len(targets.held) == 2, "the pinned buffers live until their copies are done"
    targets.drain()
    assert targets.held == []
    targets.finish()
    for d, s in targets.streams.items():  # the caller's next kernels come after the loaded values
        assert fake.current_streams[d].waited_streams == [s]


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
        m.setattr(pipeline_mod, "host_wait", cuda_error)  # the committer's wait for the copies fails too
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
