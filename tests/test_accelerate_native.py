"""The native format: checkpoint folders hold exactly stock Accelerate's files (+ manifest.json), stock Accelerate
resumes from them in a process that never imports fastckpt, damage is caught, and a killed save never commits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fastckpt_accelerate
from accelerate_testing import (Setup, assert_same, make_accelerator, reset_accelerate,
                                closing, fresh_accelerate)  # noqa: F401 (the last two are fixtures)
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.errors import CheckpointNotFoundError, IntegrityError
from fastckpt.storage.local import LocalStorage
from fastckpt.read.verify import verify_checkpoint
from fastckpt_accelerate.state import capture_state

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[1]
STOCK_FILES = {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
               "custom_checkpoint_0.pkl", "manifest.json"}


def _saved(tmp_path: Path, closing: list, safe: bool = True) -> tuple[Setup, str, dict]:
    acc = make_accelerator(tmp_path)
    closing.append(fastckpt_accelerate.enable(acc))
    setup = Setup(acc)
    for _ in range(3):
        setup.step()
    expected = setup.snapshot()
    path = acc.save_state(safe_serialization=safe)
    setup.step()  # the watched step waits for the lazy copies: the folder holds the state of save time
    closing[-1].wait()
    return setup, path, expected


# The stock side: the same model, optimizer, scheduler and counter as accelerate_testing.Setup, without fastckpt.
_STOCK_CHILD = textwrap.dedent("""
    import random, sys
    import numpy as np, torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    class Counter:
        def __init__(self): self.value, self.history = 0, []
        def state_dict(self): return {"value": self.value, "history": list(self.history)}
        def load_state_dict(self, s): self.value, self.history = s["value"], list(s["history"])

    folder, out, width = sys.argv[1], sys.argv[2], 16
    torch.manual_seed(1)  # not the saved seed: load_state must restore everything
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=sys.argv[3]))
    model = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Dropout(0.2), nn.Linear(width, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loader = DataLoader(TensorDataset(torch.randn(64, width), torch.randn(64, 1)), batch_size=8, shuffle=True)
    model, opt, sched, loader = acc.prepare(model, opt, sched, loader)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    acc.load_state(folder)
    assert not any(m.startswith("fastckpt") for m in sys.modules), "stock side imported fastckpt"
    torch.save({"model": acc.unwrap_model(model).state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "counter": counter.state_dict(), "torch_rng": torch.get_rng_state(),
                "numpy_rng": np.random.get_state(), "python_rng": random.getstate(), "step": acc.step}, out)
""")


@pytest.mark.parametrize("safe", [True, False])
def test_stock_accelerate_without_fastckpt_resumes_bit_exact(tmp_path, closing, safe):
    _, path, expected = _saved(tmp_path, closing, safe)
    names = set(os.listdir(path))
    weights = "model.safetensors" if safe else "pytorch_model.bin"
    assert names == (STOCK_FILES - {"model.safetensors"}) | {weights}, names
    child = tmp_path / "stock_child.py"
    child.write_text(_STOCK_CHILD)
    out = tmp_path / "stock.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this repository importable
    result = subprocess.run([sys.executable, str(child), path, str(out), str(tmp_path / "stockproj")],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = torch.load(out, weights_only=False)
    for key in ("model", "optimizer", "scheduler", "counter", "torch_rng", "numpy_rng", "python_rng", "step"):
        assert_same(expected[key], loaded[key], key)
    if safe:  # the keys stock writes (get_state_dict(model, unwrap=False)), in a plain safetensors file
        assert_same(expected["model"], load_file(os.path.join(path, "model.safetensors")))


def test_fastckpt_resumes_from_a_folder_stock_accelerate_wrote(tmp_path, closing):
    acc = make_accelerator(tmp_path, automatic=False)
    setup = Setup(acc)
    setup.step()
    folder = str(tmp_path / "stock" / "checkpoint_3")
    type(acc).save_state(acc, folder)  # Accelerate's own writer
    expected = setup.snapshot()
    closing.append(fastckpt_accelerate.enable(acc))
    setup.step()
    acc.load_state(folder)
    got = setup.snapshot()
    for key in ("model", "optimizer", "scheduler", "counter", "torch_rng", "step"):
        assert_same(expected[key], got[key], key)


def test_a_flipped_byte_in_any_file_is_named_before_anything_loads(tmp_path, closing):
    """Every file but the model's weights is checked before anything loads. The weights are read into the model
    as they are checked: a damaged model.safetensors leaves the model holding the file's values, nothing else."""
    setup, path, expected = _saved(tmp_path, closing)
    acc = setup.accelerator
    storage = LocalStorage(path)
    assert verify_checkpoint(storage, path)[1] == []  # what `fastckpt verify` runs, no Accelerate involved
    for name in sorted(set(os.listdir(path)) - {"manifest.json"}):
        file = Path(path, name)
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0x01
        file.write_bytes(bytes(data))
        setup.step()  # away from the saved state
        before = setup.snapshot()
        with pytest.raises(IntegrityError, match=name) as raised:
            acc.load_state(path)
        after = setup.snapshot()
        if name == "model.safetensors":
            assert "the model now holds the file's (damaged) values" in str(raised.value)
            assert_same(load_file(str(file)), after["model"])  # exactly the damaged file's tensors
            assert not torch.equal(load_file(str(file))["0.weight"], expected["model"]["0.weight"])
            after["model"] = before["model"]
        assert_same(before, after)  # nothing else was loaded (RNG, step, optimizer, scheduler, counter)
        problems = verify_checkpoint(storage, path)[1]
        assert len(problems) == 1 and name in problems[0]
        data[len(data) // 2] ^= 0x01
        file.write_bytes(bytes(data))
    acc.load_state(path)
    assert_same(expected["model"], setup.snapshot()["model"])


def test_save_state_without_project_dir_and_two_accelerators_on_one_project(tmp_path, closing):
    reset_accelerate()
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)  # no project_dir: an explicit output_dir needs no root
    closing.append(fastckpt_accelerate.enable(acc))
    setup = Setup(acc)
    setup.step()
    expected = setup.snapshot()
    out = str(tmp_path / "explicit")
    assert acc.save_state(out) == out
    closing[-1].wait()
    assert STOCK_FILES <= set(os.listdir(out))
    first = make_accelerator(tmp_path / "proj")
    second = make_accelerator(tmp_path / "proj")  # Accelerate's folders are the user's: no exclusive lock file
    for a in (first, second):
        closing.append(fastckpt_accelerate.enable(a))
    Setup(first)
    first.save_state()
    closing[-2].wait()
    assert os.listdir(tmp_path / "proj") == ["checkpoints"]
    setup.step()
    acc.load_state(out)
    assert_same(expected["model"], setup.snapshot()["model"])


def test_core_layout_checkpoints_of_earlier_versions_still_load(tmp_path, closing):
    acc = make_accelerator(tmp_path)
    setup = Setup(acc)
    setup.step()
    expected = setup.snapshot()
    from fastckpt_accelerate.state import capture_process_state

    state = capture_state(acc, 4, [capture_process_state(acc)])  # what fastckpt_accelerate <= 0.2 saved
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "checkpoints"))) as old:
        old.save(state, step=4, name="checkpoint_4").wait()
    closing.append(fastckpt_accelerate.enable(acc))
    setup.step()
    assert acc.load_state() == str(tmp_path / "checkpoints" / "checkpoint_4")
    assert_same(expected, setup.snapshot())
    assert acc.save_iteration == 5


_KILLED_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests"]
    import fastckpt_accelerate
    from accelerate_testing import Setup, make_accelerator
    acc = make_accelerator(sys.argv[1])
    checkpointing = fastckpt_accelerate.enable(acc, {"persist": {"fsync": False}})
    setup = Setup(acc, width=768)  # ~2.4 MB of weights, ~7 MB per checkpoint with AdamW's state
    for i in range(1000):
        setup.step()
        acc.save_state()
        if i == 0:
            checkpointing.wait()  # one good checkpoint before the kill
        print(f"saved {i}", flush=True)
""")


@pytest.mark.parametrize("trial", range(3))  # kill after the 2nd, 3rd, 4th save (5 trials until issue 55: ~10 s each)
def test_sigkill_during_a_save_loop_never_leaves_a_folder_that_looks_committed(tmp_path, trial):
    child = tmp_path / "child.py"
    child.write_text(_KILLED_CHILD)
    proc = subprocess.Popen([sys.executable, str(child), str(tmp_path), str(REPO)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        for _ in range(2 + trial):  # kill right after save_state returned: that save is in flight
            line = proc.stdout.readline()
            assert line.startswith("saved"), line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    root = tmp_path / "checkpoints"
    acc = make_accelerator(tmp_path)
    checkpointing = fastckpt_accelerate.enable(acc)
    try:
        setup = Setup(acc, width=768)
        committed = []
        for name in sorted(os.listdir(root)):
            folder = str(root / name)
            if os.path.exists(os.path.join(folder, "manifest.json")):
                committed.append(name)
                assert verify_checkpoint(LocalStorage(folder), folder)[1] == []
            else:
                with pytest.raises(CheckpointNotFoundError):
                    acc.load_state(folder)
        assert committed, "the saves before the kill committed"
        newest = max(committed, key=lambda n: int(n.split("_")[1]))
        assert acc.load_state() == str(root / newest)  # the previous good checkpoint loads
        assert setup.counter.value == int(newest.split("_")[1]) + 1
    finally:
        checkpointing.close()
