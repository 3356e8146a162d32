"""The CUDA path's logic that runs without a GPU: map_location, eager tensors, load waits, slot release,
and the per-device stream/event/pinning bookkeeping (with fake streams, events and cudart: bookkeeping only;
the copies themselves are tested on a real device in test_cuda.py)."""
from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

import fastckpt.engine.saver as checkpointer_mod
import fastckpt.engine.pipeline as pipeline_mod
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.errors import FastCkptError, IntegrityError, SnapshotMutatedError
from fastckpt.engine.handle import SaveHandle, SaveStats
from fastckpt.read.maplocation import placer, saved_location
from fastckpt.format.plan import Planner, flatten
from fastckpt.engine.staging import HostArena
from fastckpt.engine.streams import CopyStreams, record_done, shard_events
from fastckpt.tiers.shm import ShmTier
from tests.helpers import assert_bit_equal, clone_state


def _state() -> dict:
    torch.manual_seed(0)
    return {"a": torch.randn(64, 64), "b": torch.randn(300), "c": torch.arange(10), "n": 3}


def _saved(tmp_path, **persist):
    """A committed checkpoint spread over several files (so loads use several read threads)."""
    cfg = CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 4096, "workers": 4, **persist})
    ckpt = Checkpointer(cfg)
    state = _state()
    ckpt.save(state, step=1).wait(timeout=60)
    return ckpt, state


# ---- map_location (point 5) ---------------------------------------------------------------

def test_map_location_callable_runs_on_the_calling_thread(tmp_path) -> None:
    ckpt, state = _saved(tmp_path)
    calls = []

    def where(t, loc):
        calls.append((threading.get_ident(), loc))
        return t.clone()

    with ckpt:
        assert len(ckpt.reader()._by_file()) > 1, "the test needs several files, hence several read threads"
        loaded = ckpt.load(map_location=where)
    assert len(calls) == 3
    assert {c for c in calls} == {(threading.get_ident(), "cpu")}
    assert_bit_equal(state, loaded)


def test_map_location_callable_returning_none_keeps_the_tensor(tmp_path) -> None:
    ckpt, state = _saved(tmp_path)
    with ckpt:
        loaded = ckpt.load(map_location=lambda t, loc: None)
    assert_bit_equal(state, loaded)
    assert all(loaded[k].device.type == "cpu" for k in "abc")


@pytest.mark.parametrize("where", ["cpu", torch.device("cpu"), {"cpu": "cpu"}, {"cuda:0": "meta"}])
def test_map_location_to_the_cpu(tmp_path, where) -> None:
    ckpt, state = _saved(tmp_path)
    with ckpt:
        assert_bit_equal(state, ckpt.load(map_location=where))


def test_map_location_dict_maps_the_saved_location(tmp_path) -> None:
    ckpt, state = _saved(tmp_path)
    with ckpt:
        loaded = ckpt.load(map_location={"cpu": "meta"})
    assert all(loaded[k].device.type == "meta" and loaded[k].shape == state[k].shape for k in "abc")
    t = torch.ones(3)
    # torch.load's dict: the saved location is the key; unmapped locations stay where they were saved
    assert placer({"cuda:0": "meta"})(t, "cuda:0").device.type == "meta"
    assert placer({"cuda:0": "meta"})(t, "cpu") is t
    assert placer({"cuda:1": "meta"})(t, "cpu") is t


def test_saved_location_is_read_and_checked() -> None:
    assert saved_location({"key": "w"}, "meta.json") == "cpu"
    assert saved_location({"key": "w", "device": "cuda:1"}, "meta.json") == "cuda:1"
    with pytest.raises(IntegrityError, match="'w'.*'gpu!'"):
        saved_location({"key": "w", "device": "gpu!"}, "meta.json")


def test_map_location_rejects_what_is_not_a_device(tmp_path) -> None:
    ckpt, _ = _saved(tmp_path)
    with ckpt, pytest.raises(FastCkptError, match="'nowhere' is not a device"):
        ckpt.load(map_location="nowhere")


# ---- eager tensors and the waits before in-place writes (point 2) -------------------------

@pytest.fixture()
def copy_gate(monkeypatch):
    """Holds the copy thread's lazy copies until the event is set (the caller thread's copies pass): at its copy of
    a shard, whichever way it copies (engine/onepass.py)."""
    gate = threading.Event()
    real = pipeline_mod.Pipeline._copy_into

    def gated(*args, **kwargs):
        if threading.current_thread().name.startswith("fastckpt-copy") and not gate.wait(timeout=60):
            raise TimeoutError("test gate never opened")  # a failing test must not hang close()
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod.Pipeline, "_copy_into", gated)
    return gate


@pytest.mark.parametrize("by", ["key", "tensor"])
def test_eager_tensors_are_copied_inside_save(tmp_path, copy_gate, by) -> None:
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        state = {"m": model.state_dict()}
        ref = clone_state(state)
        h = ckpt.save(state, step=1, eager=["m/weight"] if by == "key" else [model.weight])
        # Written in place before any step (max_norm, an EMA swap): no wait runs. Through .data, which skips the
        # version counter: only the seal's sampled bytes would see it, and the eager copy needs none of that.
        model.weight.data.add_(1)
        copy_gate.set()
        h.wait(timeout=60)
        loaded = ckpt.load()
        assert torch.equal(loaded["m"]["weight"], ref["m"]["weight"])  # copied inside save()
        assert torch.equal(loaded["m"]["bias"], ref["m"]["bias"])
        # The same write to a lazy tensor, copied after it (the gate held the copy): refused at the seal, loudly.
        copy_gate.clear()
        h = ckpt.save(state, step=2, eager=["m/weight"] if by == "key" else [model.weight])
        model.bias.data.add_(1)
        copy_gate.set()
        with pytest.raises(SnapshotMutatedError, match="m/bias"):
            h.wait(timeout=60)
        assert ckpt.latest() == 1


def test_eager_refuses_what_is_not_a_tensor_or_pattern(tmp_path) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        with pytest.raises(FastCkptError, match="eager"):
            ckpt.save({"w": torch.ones(2)}, step=1, eager=[3])


def test_load_into_waits_for_pending_lazy_copies(tmp_path, copy_gate, monkeypatch) -> None:
    torch.manual_seed(0)
    model = nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copy_gate.set()
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        state = {"m": model.state_dict()}
        old = clone_state(state)
        ckpt.save(state, step=0).wait(timeout=60)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3)
        new = clone_state(state)
        copy_gate.clear()
        real = SaveHandle.wait_staged

        def opens_the_gate(self, *args, **kwargs):  # whoever waits for staging lets the copy run
            copy_gate.set()
            return real(self, *args, **kwargs)

        monkeypatch.setattr(SaveHandle, "wait_staged", opens_the_gate)
        h = ckpt.save(state, step=1)
        ckpt.load_into(state, step=0)  # writes the live parameters the pending lazy copy reads
        copy_gate.set()
        h.wait(timeout=60)
        assert_bit_equal(new, ckpt.load(step=1))
    assert_bit_equal(old, {"m": model.state_dict()})


def test_lightning_callback_waits_before_validation_test_and_predict(tmp_path) -> None:
    from fastckpt_lightning.callback import FastCheckpointCallback

    class Plugin:
        waits = 0
        config = CheckpointConfig(root=str(tmp_path))  # preemption off (its default)

        def flush(self) -> None:
            raise AssertionError("no flush expected")

        def wait_staged(self, raise_errors: bool = True) -> None:
            self.waits += 1

    plugin = Plugin()
    cb = FastCheckpointCallback(plugin)  # type: ignore[arg-type]
    cb.on_validation_start(None, None)  # type: ignore[arg-type]
    cb.on_test_start(None, None)  # type: ignore[arg-type]
    cb.on_predict_start(None, None)  # type: ignore[arg-type]
    assert plugin.waits == 3


# ---- small points ------------------------------------------------------------------------

def test_cuda_preparation_failure_leaves_no_slot_busy(tmp_path, monkeypatch) -> None:
    cfg = CheckpointConfig(root=str(tmp_path), staging={"slots": 1, "when_busy": "skip"})
    state = {"w": torch.randn(100)}
    with Checkpointer(cfg) as ckpt:
        def boom(devices, tensors=None):
            raise RuntimeError("CUDA error: out of memory")

        with monkeypatch.context() as m:  # bookkeeping only: pretend the state is on cuda:0
            m.setattr(checkpointer_mod, "cuda_devices", lambda tensors: [0])
            m.setattr(ckpt._streams, "prepare", boom)
            with pytest.raises(FastCkptError, match=r"CUDA copies of checkpoint 'step-000000001'.*\[0\]") as err:
                ckpt.save(state, step=1)
            assert isinstance(err.value.__cause__, RuntimeError)
        # A new tensor: the plan of the same one remembers the devices the patch pretended (a tensor's device
        # cannot change without its identity, which the plan's reuse checks)
        state = {"w": torch.randn(100)}
        h = ckpt.save(state, step=2)
        assert not h.skipped, "the failed save left its staging slot busy"
        h.wait(timeout=60)
        assert_bit_equal(state, ckpt.load(step=2))


# ---- per-device bookkeeping with fakes (point 1, 3, 7) -----------------------------------

class FakeEvent:
    def __init__(self, done: bool = False, **flags) -> None:
        self.done, self.flags, self.recorded, self.synced_on = done, flags, None, None

    def record(self, stream) -> None:
        self.recorded = stream

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced_on = FakeCuda.current
        self.done = True


class FakeStream:
    def __init__(self, device=None, priority=0) -> None:
        self.device, self.priority, self.waited = device, priority, []

    def wait_event(self, ev) -> None:
        self.waited.append(ev)


class FakeCuda:
    """Stands in for the few torch.cuda entry points the bookkeeping calls."""

    current = -1

    def __init__(self, monkeypatch) -> None:
        self.current_streams = {d: FakeStream(d) for d in range(4)}
        monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: self.current_streams[d])
        monkeypatch.setattr(torch.cuda, "device", self._device)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(FakeCuda, "current", d))

    class _device:
        def __init__(self, d) -> None:
            self.d = d

        def __enter__(self) -> None:
            self.prev, FakeCuda.current = FakeCuda.current, self.d

        def __exit__(self, *exc) -> None:
            FakeCuda.current = self.prev


def test_wait_staged_orders_each_events_own_device_and_drops_finished_ones(monkeypatch) -> None:
    fake = FakeCuda(monkeypatch)
    e0, e1 = FakeEvent(done=True), FakeEvent()
    h = SaveHandle(name="x", step=1, path="p", stats=SaveStats(step=1, name="x"))
    h._staged.set()
    h._cuda_events = [(0, e0), (1, e1)]
    h.wait_staged()
    assert fake.current_streams[0].waited == [e0] and fake.current_streams[1].waited == [e1]
    assert h._cuda_events == [(1, e1)], "a finished copy is waited on again at every step"
    h.wait_staged(host=True)
    assert e1.synced_on == 1, "host wait must run under the event's own device"
    assert h._cuda_events == []


def test_copy_streams_and_ready_events_are_per_device(monkeypatch) -> None:
    fake = FakeCuda(monkeypatch)
    streams = CopyStreams(lambda d, p: FakeStream(d, p))
    job = streams.prepare([0, 2])
    for d in (0, 2):
        assert job.ready[d].recorded is fake.current_streams[d]  # each device's own compute stream
        assert job.eager[d].device == d and job.lazy[d].device == d
        assert job.eager[d].priority < job.lazy[d].priority == 0  # eager copies: a higher priority
        assert job.eager[d].waited == [job.ready[d]]
        assert job.eager[d] is not job.lazy[d]
    job.begin_lazy()
    assert FakeCuda.current == 0, "the copy thread must select a device of the state"
    assert all(job.lazy[d].waited == [job.ready[d]] for d in (0, 2))
    again = streams.prepare([2])
    assert again.lazy[2] is job.lazy[2] and again.eager[2] is job.eager[2], "one copy stream per device"


def test_shard_events_are_blocking_and_keyed_by_shard_and_device(monkeypatch) -> None:
    FakeCuda(monkeypatch)
    s = FakeStream(1)
    ev = record_done(s)
    assert ev.flags == {"blocking": True} and ev.recorded is s  # a waiting I/O worker sleeps, not spins
    table = {(0, 0): "a", (0, 1): "b", (1, 0): "c"}
    assert shard_events(table, 0) == [(0, "a"), (1, "b")] and shard_events(table, 1) == [(0, "c")]


class FakeCudart:
    def __init__(self) -> None:
        self.registered: dict[int, tuple[int, int]] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr, size, flags):
        self.registered[ptr] = (size, flags)
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


@pytest.mark.parametrize("shm", [False, True])
def test_pinned_buffers_are_exact_registered_and_released(tmp_path, monkeypatch, shm) -> None:
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    flat = flatten({"a": torch.ones(1000), "b": torch.ones(3000)})
    plan = Planner(4096 * 2).plan(flat, set())
    tier = ShmTier(str(tmp_path), "file:///x") if shm else None
    arena = HostArena(1, None, tier)
    slot = arena.acquire(plan, pin=True, block=False)
    assert cudart.registered == {}, "buffers are made where a copier first asks for them, not at acquire()"
    for shard in plan.shards:
        slot.buffer(shard)
    sizes = sorted(s.nbytes for s in plan.shards)
    assert sorted(size for size, _ in cudart.registered.values()) == sizes  # exact, not powers of two
    assert {flags for _, flags in cudart.registered.values()} == {1}  # portable: pinned for every device
    assert set(cudart.registered) == {b.data_ptr() for b in slot._buffers.values()}
    if shm:
        assert slot.dir is not None, "staging.shm must stay on when the state is on CUDA"
    arena.release(slot)
    arena.close()
    assert sorted(cudart.unregistered) == sorted(cudart.registered)


class RefusingCudart(FakeCudart):
    def cudaHostRegister(self, ptr, size, flags):
        return 1  # cudaErrorInvalidValue: what a 6.18 kernel answers for a file mapping on ext4 (H200 run)


def test_shared_memory_on_a_disk_file_system_names_the_folder_and_tmpfs(tmp_path, monkeypatch) -> None:
    from fastckpt.engine.staging import fs_type

    if fs_type(str(tmp_path)) in ("tmpfs", "ramfs", "hugetlbfs", None):
        pytest.skip(f"needs pytest's tmp_path on a disk file system (it is on {fs_type(str(tmp_path))})")
    monkeypatch.setattr(torch.cuda, "cudart", lambda: RefusingCudart())
    plan = Planner(4096 * 2).plan(flatten({"a": torch.ones(1000)}), set())
    arena = HostArena(1, None, ShmTier(str(tmp_path), "file:///x"))
    with pytest.raises(FastCkptError, match=r"is on \w+, and the kernel page-locks file-backed memory only on "
                                            r"tmpfs; set staging.shm_dir to a tmpfs folder"):
        slot = arena.acquire(plan, pin=True, block=False)
        slot.buffer(plan.shards[0])  # made where a copier first asks for it
    arena.release(slot)
    assert not any(tmp_path.rglob("shard-*.bin")), "the refused slot's buffers were left behind"
    arena.close()
    assert not any(tmp_path.rglob("shard-*.bin")), "the refused slot's buffers were left behind"


def test_pinned_memory_is_not_unregistered_in_a_forked_child(tmp_path, monkeypatch) -> None:
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    plan = Planner(4096 * 2).plan(flatten({"a": torch.ones(1000)}), set())
    arena = HostArena(1, None, None)
    slot = arena.acquire(plan, pin=True, block=False)
    slot.buffer(plan.shards[0])
    real = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: real + 1)  # as in a fork()ed child: no CUDA context there
    arena.release(slot)
    arena.close()
    assert cudart.unregistered == [], "a forked child called into CUDA (it aborts: 'initialization error')"
    assert cudart.registered


def test_lightning_in_place_write_at_validation_start_comes_after_the_lazy_copy(tmp_path) -> None:
    """A callback that writes parameters in place when validation starts (loading EMA weights) runs after
    the save at the epoch's last step, with no optimizer step between: the plugin's callback must wait first."""
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from tests.lightning_support import GatedIO, RecordAfterStep, ResumableBatches, TinyModule, make_trainer

    class Validated(TinyModule):
        def validation_step(self, batch, batch_idx):
            return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    class LoadEmaAtValidation(Callback):
        def on_validation_start(self, trainer, pl_module) -> None:
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.mul_(0.5)

    plugin = GatedIO()  # lazy copies held until the training thread first waits for them
    recorder = RecordAfterStep()
    saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    trainer = make_trainer([recorder, saves, LoadEmaAtValidation()], plugin, max_epochs=1)
    trainer.fit(Validated(), train_dataloaders=ResumableBatches(), val_dataloaders=ResumableBatches())
    saved = plugin.load_checkpoint(str(tmp_path / "epoch=0-step=4.ckpt"))
    assert_bit_equal({k: saved[k] for k in ("state_dict", "optimizer_states")}, recorder.by_step[4])


def test_named_frozen_tensors_are_copied_lazily(tmp_path, copy_gate, monkeypatch) -> None:
    """save(lazy=...) moves tensors no optimizer owns (frozen base weights) out of save() into the copy thread."""
    torch.manual_seed(0)
    frozen, head = nn.Linear(32, 32), nn.Linear(32, 4)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    copied_by: dict[int, str] = {}  # data_ptr of each source -> the thread that copied it
    gated = pipeline_mod.Pipeline._copy_into

    def spy(pipe, job, shard, *rest):  # each shard's copy, whichever way it copies (engine/onepass.py)
        for e in shard.entries:
            copied_by[job.tensors[e.index].data_ptr()] = threading.current_thread().name
        return gated(pipe, job, shard, *rest)

    monkeypatch.setattr(pipeline_mod.Pipeline, "_copy_into", spy)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        state = {"base": frozen.state_dict(), "head": head.state_dict()}
        ref = clone_state(state)
        h = ckpt.save(state, step=1, lazy=["base/*"])
        assert frozen.weight.data_ptr() not in copied_by, "copied inside save(), not lazily"
        copy_gate.set()
        h.wait(timeout=60)
        loaded = ckpt.load()
    assert copied_by[frozen.weight.data_ptr()].startswith("fastckpt-copy")
    assert_bit_equal(ref["base"], loaded["base"])
    assert_bit_equal(ref["head"], loaded["head"])
