"""The shared-memory tier: a snapshot staged before SIGKILL is persisted by the next process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from fastckpt import CheckpointConfig, Checkpointer

ROOT = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent("""
    import sys, threading, torch
    from fastckpt import Checkpointer, CheckpointConfig
    from fastckpt.storage import LocalStorage
    from fastckpt import tiers
    root, shm = sys.argv[1], sys.argv[2]
    original = tiers.ShmTier.write_record
    def announce(slot_dir, job):
        original(slot_dir, job)
        print("RECORDED", job.handle.step, flush=True)
    tiers.ShmTier.write_record = staticmethod(announce)
    class Stuck(LocalStorage):
        def write_file(self, path, parts):
            if "step-000000002" in path:
                threading.Event().wait()  # the disk hangs: step 2 never reaches it
            super().write_file(path, parts)
    cfg = CheckpointConfig(root=root, staging={"shm": True, "shm_dir": shm})
    ck = Checkpointer(cfg, storage=Stuck(root))
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ck.watch(opt)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ck.save({"m": model.state_dict(), "tag": "one"}, step=1).wait()
    with torch.no_grad():
        model.weight.fill_(2.0)
    ck.save({"m": model.state_dict(), "tag": "two"}, step=2)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # waits for staging, then changes the weights
    threading.Event().wait()
""")


def test_snapshot_staged_before_sigkill_is_recovered(tmp_path) -> None:
    root, shm = tmp_path / "ckpts", tmp_path / "shm"
    shm.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), str(shm)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert lines == ["RECORDED 1", "RECORDED 2"], lines
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    cfg = CheckpointConfig(root=str(root), staging={"shm": True, "shm_dir": str(shm)})
    with Checkpointer(CheckpointConfig(root=str(root))) as plain:
        assert plain.latest() == 1  # step 2 never committed before the crash
    with Checkpointer(cfg) as ckpt:
        assert [h.step for h in ckpt.recovered] == [2]
        ckpt.recovered[0].wait()
        assert ckpt.latest() == 2
        state = ckpt.load()
        assert state["tag"] == "two"
        assert torch.equal(state["m"]["weight"], torch.full((64, 64), 2.0))
    assert not any(shm.rglob("staged.json")), "the recovered record must be cleaned up"


def test_shm_staging_cleans_up_after_itself(tmp_path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    cfg = CheckpointConfig(root=str(tmp_path / "c"), staging={"shm": True, "shm_dir": str(shm)})
    with Checkpointer(cfg) as ckpt:
        ckpt.save({"w": torch.ones(128)}, step=1).wait()
        assert not any(shm.rglob("staged.json"))  # committed: nothing left to recover
        assert any(shm.rglob("shard-*.bin"))  # the buffers stay for reuse
        assert torch.equal(ckpt.load()["w"], torch.ones(128))
    assert not any(shm.rglob("*.bin")), "close() must release the shared memory"
    with Checkpointer(cfg) as again:
        assert again.recovered == []
