"""Where staging buffers are made and page-locked (found on an H200: the first save() of 1.96 GB spent 772 ms in
``cudaHostRegister`` of fresh buffers, and with ``persist.process`` the first saves grew to 0.8-1.4 s).

A slot makes each buffer where a copier first asks for it: an eager shard's inside ``save()``, a lazy shard's on the
copy thread, so ``save()`` of a lazy state allocates and page-locks nothing on the training thread; every buffer is
page-locked once in its slot's life, not once per save. Checked on the CPU with fake CUDA (tests/test_cuda_logic.py,
tests/test_shm_cuda_staging.py) and a fake cudart that records the thread of each registration; the real-device
counterpart is ``test_first_save_registers_lazy_buffers_on_the_copy_thread_on_a_gpu``."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, FastCkptError
from fastckpt.tiers.persister import PersistedPipeline
from fastckpt.tiers.shm import ShmTier
from tests.helpers import assert_bit_equal, clone_state
from tests.test_shm_cuda_staging import Dma, install

WAIT_S = 60.0  # a safety net only: every wait is on a handle's future or an event


class ThreadCudart:
    """A fake ``torch.cuda.cudart()`` recording which thread registered which buffer; ``refuse`` answers an error
    code instead (2: cudaErrorMemoryAllocation) for registrations on threads whose name starts with it."""

    def __init__(self, refuse: str | None = None) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int, int]] = []  # (thread name, pointer, size)
        self.unregistered: list[int] = []
        self.refuse = refuse

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        name = threading.current_thread().name
        if self.refuse is not None and name.startswith(self.refuse):
            return 2
        with self.lock:
            self.calls.append((name, ptr, size))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        with self.lock:
            self.unregistered.append(ptr)
        return 0

    def threads(self) -> list[str]:
        with self.lock:
            return [name for name, _, _ in self.calls]


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, cudart: ThreadCudart) -> None:
    dma = Dma()
    dma.gate.set()  # copies land at once: this file is about where buffers are made, not when copies land
    install(monkeypatch, dma)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)


def _model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, opt)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()


def _config(tmp_path: Path, shm: Path | None, **persist: Any) -> CheckpointConfig:
    """``shm``: a tmpfs folder (the ``tmpfs_dir`` fixture) for ``staging.shm``, as on a GPU host, or None."""
    staging: dict[str, Any] = {"shm": shm is not None}
    if shm is not None:
        staging["shm_dir"] = str(shm)
    return CheckpointConfig(root=str(tmp_path / "ck"), staging=staging,
                            persist={"chunk_bytes": 8192, "fsync": False, **persist})


def _shards(ckpt: Checkpointer, lazy: bool) -> list[int]:
    """The sizes of the shards of the one plan staged so far that are lazy (or eager)."""
    [slots] = ckpt._arena._slots.values()
    return sorted(s.nbytes for s in slots[0].plan.mine(slots[0].plan.shards) if s.lazy == lazy)


@pytest.mark.parametrize("shm", [False, True])
def test_lazy_buffers_are_made_and_page_locked_on_the_copy_thread(tmp_path, monkeypatch, request, shm) -> None:
    shm = request.getfixturevalue("tmpfs_dir") if shm else None
    cudart = ThreadCudart()
    _fake_gpu(monkeypatch, cudart)
    model, opt = _model()
    me = threading.current_thread().name
    with Checkpointer(_config(tmp_path, shm)) as ckpt:
        ckpt.watch(opt)
        ema = torch.randn(300)  # no watched optimizer owns it: copied eagerly, inside save()
        state = {"m": model.state_dict(), "o": opt.state_dict(), "ema": ema}
        ref = clone_state(state)
        h = ckpt.save(state, step=1)
        h.wait(timeout=WAIT_S)
        lazy, eager = _shards(ckpt, True), _shards(ckpt, False)
        assert len(lazy) > 1 and eager, "the test needs several lazy shards and an eager one"
        calls = list(cudart.calls)
        # Before the fix every buffer was made and registered inside save(), on this thread.
        assert sorted(size for name, _, size in calls if name == me) == eager
        assert sorted(size for name, _, size in calls if name.startswith("fastckpt-copy")) == lazy
        assert len(calls) == len(lazy) + len(eager)
        assert_bit_equal(ref, ckpt.load(step=1))
        # Later saves reuse the slot: nothing is made or registered again, on any thread.
        allocations = ckpt.counters["host_allocations"]
        for step in (2, 3):
            _step(model, opt)
            ref = clone_state(state)
            ckpt.save(state, step=step).wait(timeout=WAIT_S)
            assert_bit_equal(ref, ckpt.load(step=step))
        assert cudart.calls == calls and ckpt.counters["host_allocations"] == allocations
    assert sorted(cudart.unregistered) == sorted(ptr for _, ptr, _ in calls), "close() must unlock every buffer"


def test_ring_buffers_of_lazy_shards_are_made_on_the_copy_thread(tmp_path, monkeypatch) -> None:
    cudart = ThreadCudart()
    _fake_gpu(monkeypatch, cudart)
    model, opt = _model()
    cfg = CheckpointConfig(root=str(tmp_path), staging={"max_host_bytes": 3 * 8192},
                           persist={"chunk_bytes": 8192, "fsync": False})
    with Checkpointer(cfg) as ckpt:
        ckpt.watch(opt)
        state = {"m": model.state_dict(), "o": opt.state_dict()}
        for step in (1, 2):
            ref = clone_state(state)
            ckpt.save(state, step=step).wait(timeout=WAIT_S)
            assert_bit_equal(ref, ckpt.load(step=step))
            _step(model, opt)
        [slots] = ckpt._arena._slots.values()
        assert slots[0].ring
        threads = cudart.threads()
        assert threads and all(t.startswith("fastckpt-copy") for t in threads), threads
        assert len(threads) == slots[0].ring_count <= 3, "a ring buffer is made once and reused"


@pytest.mark.parametrize("shm", [False, True])
def test_a_buffer_the_copy_thread_cannot_page_lock_fails_that_save_once(tmp_path, monkeypatch, request,
                                                                         shm) -> None:
    shm = request.getfixturevalue("tmpfs_dir") if shm else None
    cudart = ThreadCudart()
    _fake_gpu(monkeypatch, cudart)
    model, opt = _model()
    with Checkpointer(_config(tmp_path, shm)) as ckpt:
        ckpt.watch(opt)
        state = {"m": model.state_dict(), "o": opt.state_dict()}
        ref = clone_state(state)
        ckpt.save(state, step=1).wait(timeout=WAIT_S)
        # A new structure needs a new slot, whose lazy buffers the copy thread fails to page-lock.
        cudart.refuse = "fastckpt-copy"
        bigger = nn.Linear(64, 200)
        bigger_opt = torch.optim.SGD(bigger.parameters(), lr=0.1)
        ckpt.watch(bigger_opt)
        failed = threading.Event()
        h = ckpt.save({"m": bigger.state_dict()}, step=2)  # save() itself made nothing: it returns
        h.add_done_callback(lambda _: failed.set())
        h.wait_staged(timeout=WAIT_S)  # the seal (the optimizer's pre-hook): the committer may now fail it
        assert failed.wait(WAIT_S)
        cudart.refuse = None
        with pytest.raises(FastCkptError, match=r"cannot page-lock \d+ bytes of .*cudaHostRegister error 2") as err:
            ckpt.save(state, step=3)  # the failure is raised here, at the next call...
        assert "staging.max_host_bytes" in str(err.value)
        h3 = ckpt.save(state, step=3)  # ...once
        h3.wait(timeout=WAIT_S)
        ckpt.wait()
        assert [i.step for i in ckpt.list()] == [1, 3], "the failed save must leave no checkpoint"
        assert_bit_equal(ref, ckpt.load(step=1))  # the previous checkpoint is intact
        assert_bit_equal(ref, ckpt.load(step=3))
        if shm is not None:  # the failed slot's folder (a half-made buffer file) is gone, not reused
            assert len(list(shm.rglob("slot-*"))) == 1


def test_persister_saves_page_lock_each_shm_buffer_once(tmp_path, monkeypatch, tmpfs_dir) -> None:
    """persist.process on (H200: save() blocked 797, 1106, 1392 ms): the saves after the first make nothing inside
    save(), and every shared-memory buffer is made and page-locked once in the slot's life, not once per save."""
    cudart = ThreadCudart()
    _fake_gpu(monkeypatch, cudart)
    made: list[str] = []
    real_alloc = ShmTier.alloc

    def alloc(self: ShmTier, *args: Any) -> Any:
        made.append(threading.current_thread().name)
        return real_alloc(self, *args)

    monkeypatch.setattr(ShmTier, "alloc", alloc)
    model, opt = _model()
    me = threading.current_thread().name
    with Checkpointer(_config(tmp_path, tmpfs_dir, process="on")) as ckpt:
        assert isinstance(ckpt._pipeline, PersistedPipeline)
        ckpt.watch(opt)
        state = {"m": model.state_dict(), "o": opt.state_dict()}
        refs, handles = [], []
        for step in (1, 2, 3, 4):
            refs.append(clone_state(state))
            handles.append(ckpt.save(state, step=step))  # overlapping saves: up to staging.slots (2) slots
            _step(model, opt)  # the optimizer's pre-hook waits for the copy
        for h in handles:
            h.wait(timeout=WAIT_S)
            # staged = every copy seen done (before its CRC and the record): was 0.0 (H200 run, `details`)
            assert 0 < h.stats.staging_ms <= h.stats.persist_s * 1e3, h.stats
        for step, ref in enumerate(refs, 1):
            assert_bit_equal(ref, ckpt.load(step=step))
        assert me not in made and me not in cudart.threads(), "save() made or page-locked a buffer"
        ptrs = [ptr for _, ptr, _ in cudart.calls]
        assert len(ptrs) == len(set(ptrs)) == len(made) == ckpt.counters["host_allocations"]
        slots = [s for v in ckpt._arena._slots.values() for s in v]
        assert len(made) == len(slots) * len(_shards(ckpt, True)), "every shm buffer page-locked once per slot"
        assert ckpt._pipeline.persister.pid is not None, "the persister process wrote them"


class _Recording:
    """The real ``torch.cuda.cudart()`` with each registration's thread recorded (the real device's counterpart of
    ``ThreadCudart``)."""

    def __init__(self, real: Any) -> None:
        self.real, self.threads = real, []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any:
        self.threads.append(threading.current_thread().name)
        return self.real.cudaHostRegister(ptr, size, flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
@pytest.mark.parametrize("shm", [False, True])
def test_first_save_registers_lazy_buffers_on_the_copy_thread_on_a_gpu(tmp_path, monkeypatch, request, shm) -> None:
    shm = request.getfixturevalue("tmpfs_dir") if shm else None
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).cuda()  # 8 x 4 MiB of weights
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.zero_grad()
    model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
    opt.step()
    cudart = _Recording(torch.cuda.cudart())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    me = threading.current_thread().name
    with Checkpointer(_config(tmp_path, shm)) as ckpt:
        ckpt.watch(opt)
        state = {"m": model.state_dict(), "o": opt.state_dict()}
        ref = clone_state(state)
        h = ckpt.save(state, step=1)
        assert me not in cudart.threads, "save() page-locked a lazy buffer"
        h.wait(timeout=WAIT_S)
        assert cudart.threads and all(t.startswith("fastckpt-copy") for t in cudart.threads), cudart.threads
        [slots] = ckpt._arena._slots.values()
        assert all(b.is_pinned() for b in slots[0]._buffers.values())
        assert_bit_equal(ref, ckpt.load(step=1, map_location="cpu"))


def test_auto_keeps_a_cuda_state_on_the_threads(tmp_path, monkeypatch, tmpfs_dir) -> None:
    """persist.process auto: on an H200 the process stalled training 1150 ms a checkpoint against the threads'
    113 ms, so a CUDA state stays on the threads however big; "on" still routes it (the test above)."""
    import fastckpt.tiers.persister as persister_mod

    monkeypatch.setattr(persister_mod, "AUTO_MIN_BYTES", 1024)  # every state here is "big"
    _fake_gpu(monkeypatch, ThreadCudart())
    model, opt = _model()
    with Checkpointer(_config(tmp_path, tmpfs_dir, process="auto")) as ckpt:
        pipeline = ckpt._pipeline
        assert isinstance(pipeline, PersistedPipeline)
        ckpt.watch(opt)
        state = {"m": model.state_dict(), "o": opt.state_dict()}
        ref = clone_state(state)
        h = ckpt.save(state, step=1)
        _step(model, opt)
        h.wait(timeout=WAIT_S)
        assert pipeline.persister.proc is None, "auto sent a CUDA state to the persister process"
        assert_bit_equal(ref, ckpt.load(step=1))
