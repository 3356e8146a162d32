"""Issue 24: with ``staging.shm`` on GPU, ``save()`` returns while the device-to-host copies still run; the copy
thread takes their CRCs once the copies landed, and only then writes the shared-memory record. Checked on the CPU
with fake CUDA copies that land only when the test lets the fake DMA run (and a SIGKILLed child process in between
for the crash side); the real-device counterpart is in test_cuda_device.py."""
from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Any

import torch

import fastckpt.engine.cudastage as cudastage_mod
import fastckpt.engine.saver as saver_mod
import fastckpt.engine.streams as streams_mod
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.engine.cudacopy import DeviceBatch
from fastckpt.engine.devicehealth import DeviceStats, figures
from fastckpt.format.checksum import crc32c
from fastckpt.format.plan import flatten
from fastckpt.storage.local import LocalStorage
from tests.helpers import GatedStorage, assert_bit_equal, bounded, clone_state, run_child
from tests.test_cuda_logic import FakeCuda, FakeCudart, FakeStream

WAIT_S = 10.0  # a fake copy that is never let land fails its wait after this, instead of hanging the test


class Patch:
    """``monkeypatch.setattr`` for a child process, where the patches last until it dies."""

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        setattr(obj, name, value)


class Dma:
    """Fake device-to-host copies: queued bytes land in the staging buffer only once ``gate`` is set and a wait or a
    query on one of their events sees it (until then the buffer keeps what it held: a CRC taken early is wrong)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self._lock = threading.Lock()
        self._queued: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._events: list["DmaEvent"] = []

    def batches(self, entries: Any, tensors: list) -> tuple[list[DeviceBatch], list]:
        """Stands in for ``device_batches``: every non-empty source is taken for one on cuda:0."""
        batch = DeviceBatch(0)
        for pos, e in enumerate(entries):
            if e.nbytes:
                batch.positions.append(pos)
                batch.sources.append(tensors[e.index])
        return ([batch] if batch.positions else []), []

    def copy(self, views: list, batch: DeviceBatch, stream: Any) -> None:
        """Stands in for ``queue_copies``: the sources' values are taken now (the copy stream is ordered before the
        caller's next kernels), written into their staged views when the DMA lands."""
        with self._lock:
            for pos, src in zip(batch.positions, batch.sources):
                self._queued.append((views[pos], src.detach().clone()))

    def stats(self, batch: DeviceBatch, stream: Any) -> DeviceStats | None:
        """Stands in for ``queue_stats``: the device's figures, computed here on the CPU sources."""
        got = figures(batch)
        return None if got is None else DeviceStats(*got)

    def event(self, stream: Any) -> "DmaEvent":
        """Stands in for ``record_done``."""
        ev = DmaEvent(self)
        with self._lock:
            self._events.append(ev)
        return ev

    def land(self) -> bool:
        if not self.gate.is_set():
            return False
        with self._lock:  # held while the bytes land: a second waiter must not see them half written
            for view, src in self._queued:
                view.copy_(src)
            for ev in self._events:
                ev.done = True
            self._queued, self._events = [], []
        return True


class DmaEvent:
    def __init__(self, dma: Dma) -> None:
        self.dma, self.done = dma, False

    def record(self, stream: Any) -> None:
        pass

    def query(self) -> bool:
        return self.done or self.dma.land()

    def synchronize(self) -> None:
        if self.done:
            return
        if not self.dma.gate.wait(WAIT_S):
            raise RuntimeError("the fake CUDA copy never completed")
        self.dma.land()


def install(patch: Any, dma: Dma) -> None:
    """Pretend the state lives on cuda:0: fake streams and events (tests/test_cuda_logic.py), a fake cudart for the
    pinned registration, and copies that land when ``dma`` lets them."""
    FakeCuda(patch)
    cudart = FakeCudart()
    patch.setattr(torch.cuda, "cudart", lambda: cudart)
    patch.setattr(saver_mod, "cuda_devices", lambda tensors: [0])
    patch.setattr(streams_mod, "process_stream", lambda d, p: FakeStream(d, p))
    patch.setattr(cudastage_mod, "device_batches", dma.batches)
    patch.setattr(cudastage_mod, "queue_copies", dma.copy)
    patch.setattr(cudastage_mod, "queue_stats", dma.stats)
    patch.setattr(cudastage_mod, "record_done", dma.event)


def config(root: str, shm: str) -> CheckpointConfig:
    return CheckpointConfig(root=root, staging={"shm": True, "shm_dir": shm},
                            persist={"chunk_bytes": 4096, "fsync": False})


def state_of(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"a": torch.randn(40, 50, generator=g), "b": torch.arange(700, dtype=torch.int64) * step,
            "c": torch.randn(300, generator=g).to(torch.bfloat16), "n": step}


def _records(shm: Path, name: str = "staged.json") -> list[Path]:
    return sorted(shm.rglob(name))


def test_save_returns_before_the_copies_land_and_the_record_claims_only_checked_bytes(tmp_path, monkeypatch) -> None:
    dma = Dma()
    install(monkeypatch, dma)
    shm = tmp_path / "shm"
    shm.mkdir()
    storage = GatedStorage(LocalStorage(str(tmp_path / "ck"), fsync=False))  # the record stays uncommitted
    state = state_of(1)
    ref = clone_state(state)
    with Checkpointer(config(str(tmp_path / "ck"), str(shm)), storage=storage) as ckpt:
        # before the fix, save() itself waited for the copies to land (here: for WAIT_S, then failed)
        h = bounded(lambda: ckpt.save(state, step=1), WAIT_S / 2)
        assert not h.staged(), "wait_staged() must not return before the record is written"
        assert _records(shm) == [], "a record written before the copies landed claims bytes not staged"
        dma.gate.set()  # the GPU drains
        h.wait_staged(timeout=30)
        [record] = _records(shm)
        doc = json.loads(record.read_text())
        tensors = flatten(ref).tensors
        checked = 0
        for index, crcs in doc["crcs"].items():
            data = (record.parent / f"shard-{int(index):05d}.bin").read_bytes()
            mine = [i for i, e in enumerate(doc["entries"]) if e[4] == int(index)]
            for i, want in zip(mine, crcs):
                _, _, nbytes, _, _, offset = doc["entries"][i]
                staged = data[offset: offset + nbytes]
                assert staged == tensors[i].contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                assert crc32c(staged) == want
                checked += 1
        assert checked == len(tensors) and len(doc["crcs"]) > 1, "every shard of the snapshot must be recorded"
        storage.gate.set()
        h.wait(timeout=60)
        assert_bit_equal(ref, ckpt.load(step=1))


_CHILD = """
import os, signal, sys
from fastckpt import Checkpointer
from fastckpt.storage.local import LocalStorage
from tests.helpers import GatedStorage
from tests.test_shm_cuda_staging import Dma, Patch, config, install, state_of

root, shm = sys.argv[1:3]
dma = Dma()
install(Patch(), dma)
storage = GatedStorage(LocalStorage(root, fsync=False))  # nothing commits: both snapshots live in shared memory only
ck = Checkpointer(config(root, shm), storage=storage)
dma.gate.set()
ck.save(state_of(1), step=1).wait_staged(timeout=30)
dma.gate.clear()  # step 2's copies never land: the process dies first
try:
    h = ck.save(state_of(2), step=2)
except BaseException as e:  # the unfixed engine: save() waited for the copies; exit now, not after the flush
    print("raised", repr(e), flush=True)
    os._exit(3)
print("returned", h.staged(), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_crash_before_the_copies_are_checked_recovers_the_previous_snapshot(tmp_path) -> None:
    root, shm = tmp_path / "ck", tmp_path / "shm"
    shm.mkdir()
    proc = run_child(_CHILD, str(root), str(shm))
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.split() == ["returned", "False"], proc.stderr
    assert [json.loads(r.read_text())["step"] for r in _records(shm)] == [1], "step 2 must have no record"
    with Checkpointer(config(str(root), str(shm))) as ck:
        assert [h.step for h in ck.recovered] == [1]
        assert [i.step for i in ck.list()] == [1], "the torn step 2 must not be recovered"
        assert_bit_equal(state_of(1), ck.load(step=1))
    assert not list(shm.rglob("*.bin")), "step 2's unrecorded buffers must be removed"
