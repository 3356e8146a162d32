"""persist.cpu_threads: the background threads' CPU-bound sections pass a gate sized to the cores training leaves
over, the copy thread first (fastckpt/engine/cpugate.py)."""
from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, ConfigError
from fastckpt.engine import cpugate
from fastckpt.engine.cpugate import CpuGate, auto_limit

DEADLINE_S = 30.0


def _until_waiting(gate: CpuGate, n: int, what: str) -> None:
    """Until ``n`` entries wait at ``gate`` (notified by the gate, never a fixed sleep); fail naming ``what``."""
    assert gate.wait_for_waits(n, DEADLINE_S), f"timed out waiting for {what}"


class _Holder(threading.Thread):
    """Enters the gate, records the order of entry, then holds it until released."""

    def __init__(self, gate: CpuGate, name: str, order: list[str], urgent: bool = False) -> None:
        super().__init__(name=name, daemon=True)
        self.gate, self.order, self.urgent = gate, order, urgent
        self.inside = threading.Event()
        self.release = threading.Event()

    def run(self) -> None:
        with self.gate.held(urgent=self.urgent):
            self.order.append(self.name)
            self.inside.set()
            self.release.wait(DEADLINE_S)


def _one_inside_one_waiting(gate: CpuGate, order: list[str]) -> tuple[_Holder, _Holder]:
    """Thread a inside ``gate`` (limit 1), thread b waiting at it."""
    a, b = _Holder(gate, "a", order), _Holder(gate, "b", order)
    a.start()
    assert a.inside.wait(DEADLINE_S)
    b.start()
    _until_waiting(gate, 1, "b to wait at the gate")
    return a, b


def test_a_limit_of_one_admits_one_section_at_a_time() -> None:
    gate, order = CpuGate(1), []
    a, b = _one_inside_one_waiting(gate, order)
    assert order == ["a"] and not b.inside.is_set()
    a.release.set()
    assert b.inside.wait(DEADLINE_S)
    b.release.set()
    for t in (a, b):
        t.join(DEADLINE_S)
    assert order == ["a", "b"]


def test_the_copy_thread_goes_before_waiting_io_threads() -> None:
    gate, order = CpuGate(1), []
    holder = _Holder(gate, "io-0", order)
    holder.start()
    assert holder.inside.wait(DEADLINE_S)
    io = _Holder(gate, "io-1", order)
    io.start()
    _until_waiting(gate, 1, "the second I/O thread to wait")
    copy = _Holder(gate, "copy", order, urgent=True)
    copy.start()
    _until_waiting(gate, 2, "the copy thread to wait")
    holder.release.set()
    assert copy.inside.wait(DEADLINE_S)
    assert order == ["io-0", "copy"]  # the I/O thread waiting longer still lets the copy in first
    copy.release.set()
    assert io.inside.wait(DEADLINE_S)
    io.release.set()
    for t in (holder, io, copy):
        t.join(DEADLINE_S)
    assert order == ["io-0", "copy", "io-1"]


def test_a_nested_section_on_the_same_thread_passes() -> None:
    gate = CpuGate(1)
    with gate.held():
        with gate.held():  # a buffered write inside a checksum section: no self-deadlock
            pass
    assert gate.waits == 0


def test_raising_the_limit_admits_the_waiters() -> None:
    gate, order = CpuGate(1), []
    a, b = _one_inside_one_waiting(gate, order)
    gate.limit = 2
    assert b.inside.wait(DEADLINE_S)  # while a still holds its section
    assert a.is_alive() and not a.release.is_set()
    a.release.set()
    b.release.set()
    for t in (a, b):
        t.join(DEADLINE_S)


def test_an_exception_inside_a_section_frees_it() -> None:
    gate = CpuGate(1)
    with pytest.raises(RuntimeError):
        with gate.held():
            raise RuntimeError("a failing checksum")
    done = threading.Event()

    def enter() -> None:
        with gate.held():
            done.set()

    threading.Thread(target=enter, daemon=True).start()
    assert done.wait(DEADLINE_S)


def test_auto_leaves_the_training_threads_their_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpugate, "usable_cpus", lambda: 16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert auto_limit() == 12
        assert auto_limit(on_gpu=True) == 15  # a GPU job keeps one launching thread busy
        torch.set_num_threads(16)
        assert auto_limit() == 1  # never none
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(cpugate, "usable_cpus", lambda: 1)
    assert auto_limit(on_gpu=True) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "many", None])
def test_cpu_threads_refuses_what_is_not_auto_or_a_positive_integer(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"persist\.cpu_threads must be auto or an integer >= 1"):
        CheckpointConfig(root="/tmp/x", persist={"cpu_threads": bad})


class _Recording(CpuGate):
    """Counts the sections inside at once, and which threads entered."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.peak = 0
        self.now = 0
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def held(self, urgent: bool = False):  # type: ignore[override]
        outer = super().held(urgent)
        gate = self

        class _Counted:
            def __enter__(self) -> None:
                outer.__enter__()
                with gate._lock:
                    gate.now += 1
                    gate.peak = max(gate.peak, gate.now)
                    gate.threads.add(re.sub(r"-\d+(_\d+)?$", "", threading.current_thread().name))

            def __exit__(self, *exc: object) -> None:
                with gate._lock:
                    gate.now -= 1
                outer.__exit__(*exc)

        return _Counted()


def _recording_gate(ckpt: Checkpointer, limit: int) -> _Recording:
    pipeline = ckpt._saver.pipeline
    gate = _Recording(limit)
    pipeline.gate = gate
    if hasattr(pipeline.storage, "cpu_section"):
        pipeline.storage.cpu_section = gate.held
    return gate


def _state(n: int = 12) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(n)}  # 1 MiB each


def test_one_cpu_thread_serializes_copy_checksums_and_writes_of_a_lazy_save(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    config = CheckpointConfig(root=str(tmp_path), persist={"workers": 3, "chunk_bytes": 1 << 20})
    with Checkpointer(config) as ckpt:
        gate = _recording_gate(ckpt, 1)
        ckpt.watch(opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        ckpt.save(state, step=1).wait()
        assert gate.peak == 1, "two CPU-bound sections ran at once under persist.cpu_threads 1"
        assert {"fastckpt-copy", "fastckpt-io"} <= gate.threads, gate.threads
        loaded = ckpt.load(1)
    for k, v in expected.items():
        assert torch.equal(loaded["model"][k], v), k


def test_a_torch_file_commit_writes_through_the_gate(tmp_path: Path) -> None:
    state = _state()
    config = CheckpointConfig(root=str(tmp_path), persist={"workers": 2, "chunk_bytes": 2 << 20})
    with Checkpointer(config) as ckpt:
        gate = _recording_gate(ckpt, 1)
        ckpt.save_file(state, "model.pt").wait()
        assert gate.peak == 1
        assert "fastckpt-commit" in gate.threads, gate.threads  # its buffered write: the kernel's copy
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    for k, v in state.items():
        assert torch.equal(loaded[k], v), k


def test_the_default_is_auto_and_follows_the_training_threads(tmp_path: Path) -> None:
    assert CheckpointConfig(root=str(tmp_path)).persist.cpu_threads == "auto"
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        limit = ckpt._saver.pipeline.gate.limit
        assert limit is not None and limit() == auto_limit()
    with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"cpu_threads": 3})) as ckpt:
        assert ckpt._saver.pipeline.gate.limit() == 3


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
def test_a_ring_slot_smaller_than_the_state_does_not_deadlock_on_the_gate(tmp_path: Path, workers: int) -> None:
    """Ring mode: the copy thread waits for a buffer that only an I/O worker's write frees. Holding the gate while
    waiting (the first version) deadlocked: the worker waited for the gate to checksum."""
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8 MiB of parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = CheckpointConfig(root=str(tmp_path), persist={"workers": workers, "cpu_threads": 1,
                                                           "chunk_bytes": 1 << 20},
                              staging={"max_host_bytes": 3 << 20})
    with Checkpointer(config) as ckpt:
        ckpt.watch(opt)
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        handle = ckpt.save({"model": model.state_dict()}, step=1)
        assert ckpt._saver.pipeline.gate.limit() == 1
        model(torch.randn(2, 512)).sum().backward()
        opt.step()  # waits for staging: hung here before the fix
        handle.wait()
        loaded = ckpt.load(1)
    for k, v in expected.items():
        assert torch.equal(loaded["model"][k], v), k
