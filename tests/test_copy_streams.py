"""Issue 24: the copy streams are fastckpt's own (``cudaStreamCreateWithPriority`` through the loaded CUDA runtime),
not torch's pool streams that NCCL or FSDP2 may be using; made once per device and priority in a process, under
their device. Checked on the CPU with a fake runtime; the real-device counterpart is in test_cuda_device_streams.py."""
from __future__ import annotations

import ctypes
import logging
from typing import Any

import pytest
import torch

import fastckpt.cudart as cudart_mod
import fastckpt.engine.streams as streams_mod
from fastckpt import Checkpointer
from fastckpt.engine.streams import CopyStreams, dedicated_stream
from fastckpt.errors import FastCkptError
from tests.helpers import assert_bit_equal, clone_state
from tests.test_cuda_logic import FakeCuda, FakeStream
from tests.test_shm_cuda_staging import Dma, config, install, state_of

_real_process_stream = streams_mod.process_stream


class FakeRuntime:
    """The few libcudart calls ``dedicated_stream`` makes, with a current device of its own (like the real one)."""

    def __init__(self, fail: int = 0) -> None:
        self.device, self.fail, self.next = 3, fail, 0x1000
        self.created: list[tuple[int, int, int, int]] = []  # (handle, device, flags, priority)
        self.last_error_reads = 0

    def cudaGetDevice(self, out: Any) -> int:
        out._obj.value = self.device
        return 0

    def cudaSetDevice(self, d: Any) -> int:
        self.device = d.value if isinstance(d, ctypes.c_int) else d
        return 0

    def cudaDeviceGetStreamPriorityRange(self, least: Any, greatest: Any) -> int:
        least._obj.value, greatest._obj.value = 0, -5
        return 0

    def cudaStreamCreateWithPriority(self, out: Any, flags: Any, priority: Any) -> int:
        if self.fail:
            return self.fail
        self.next += 0x10
        out._obj.value = self.next
        self.created.append((self.next, self.device, flags.value, priority.value))
        return 0

    def cudaGetLastError(self) -> int:
        self.last_error_reads += 1
        return 0


class FakeExternalStream(FakeStream):
    def __init__(self, ptr: int, device: Any = None) -> None:
        super().__init__(device)
        self.cuda_stream = ptr


def _runtime(monkeypatch, lib: Any) -> None:
    FakeCuda(monkeypatch)
    monkeypatch.setattr(cudart_mod, "loaded_cudart", lambda: lib)
    monkeypatch.setattr(torch.cuda, "ExternalStream", FakeExternalStream)


def test_copy_streams_are_made_once_per_device_and_priority(monkeypatch) -> None:
    made: list[tuple[int, int]] = []

    def factory(d: int, p: int) -> Any:
        made.append((d, p))
        return FakeStream(d, p)

    FakeCuda(monkeypatch)
    streams = CopyStreams(factory)
    first = streams.prepare([0, 2])
    again = streams.prepare([2, 0])
    assert sorted(made) == [(0, -64), (0, 0), (2, -64), (2, 0)], "one eager and one lazy stream per device"
    assert again.eager == first.eager and again.lazy == first.lazy


def test_checkpointers_share_the_processs_dedicated_streams(tmp_path, monkeypatch) -> None:
    install(monkeypatch, dma := Dma())  # a state on a fake cuda:0
    dma.gate.set()
    lib = FakeRuntime()
    monkeypatch.setattr(cudart_mod, "loaded_cudart", lambda: lib)
    monkeypatch.setattr(torch.cuda, "ExternalStream", FakeExternalStream)
    monkeypatch.setattr(streams_mod, "process_stream", _real_process_stream)  # install() faked it
    monkeypatch.setattr(streams_mod, "_made", {})
    state = state_of(1)
    ref = clone_state(state)
    (tmp_path / "shm").mkdir()
    for run in ("one", "two"):
        with Checkpointer(config(str(tmp_path / run), str(tmp_path / "shm"))) as ckpt:
            for step in (1, 2):
                ckpt.save(state, step=step).wait(timeout=60)
            assert_bit_equal(ref, ckpt.load(step=2))
    assert [(d, prio) for _, d, _, prio in lib.created] == [(0, -5), (0, 0)], (
        "one eager and one lazy stream of device 0 for the whole process, not from torch's pool")


def test_a_dedicated_stream_is_created_under_its_device(monkeypatch) -> None:
    lib = FakeRuntime()
    _runtime(monkeypatch, lib)
    eager = dedicated_stream(1, -64)
    lazy = dedicated_stream(2, 0)
    assert [(d, flags, prio) for _, d, flags, prio in lib.created] == [(1, 1, -5), (2, 1, 0)], (
        "non-blocking, priority clamped to the device's range, each on its own device")
    assert (eager.cuda_stream, eager.device.type, eager.device.index) == (lib.created[0][0], "cuda", 1)
    assert (lazy.cuda_stream, lazy.device.type, lazy.device.index) == (lib.created[1][0], "cuda", 2)
    assert lib.device == 3, "the runtime's current device must be restored"


def test_a_failed_stream_creation_names_the_device_and_resets_the_error(monkeypatch) -> None:
    lib = FakeRuntime(fail=2)
    _runtime(monkeypatch, lib)
    with pytest.raises(FastCkptError, match=r"cudaStreamCreateWithPriority failed on cuda:1 \(CUDA error 2\)"):
        dedicated_stream(1, 0)
    assert lib.last_error_reads == 1 and lib.device == 3


def test_without_a_loaded_runtime_a_pool_stream_is_used_and_said_once(monkeypatch, caplog) -> None:
    _runtime(monkeypatch, None)
    monkeypatch.setattr(cudart_mod, "_fallback_logged", False)
    with caplog.at_level(logging.DEBUG, logger="fastckpt"):
        first = dedicated_stream(0, -64)
        dedicated_stream(1, 0)
    assert isinstance(first, FakeStream) and (first.device, first.priority) == (0, -64)
    assert len([r for r in caplog.records if "pool streams" in r.getMessage()]) == 1
