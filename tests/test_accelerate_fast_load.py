"""load_state through fastckpt's readers (issue 13): the model's safetensors read straight into its tensors, the
torch files checked and mapped, every byte checked against the manifest as it is read; stock semantics kept
(strict, errors, the stock folder), on one and two processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import fastckpt_accelerate
from accelerate_testing import (Setup, assert_same, make_accelerator,
                                closing, fresh_accelerate)  # noqa: F401 (the last two are fixtures)
from fastckpt.errors import IntegrityError
from fastckpt.storage.local import LocalStorage
from fastckpt.format.torchfile import record_spans
from fastckpt.read.verify import verify_checkpoint

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[1]
RESTORED = ("model", "optimizer", "scheduler", "counter", "torch_rng", "numpy_rng", "python_rng", "step")


def _saved(tmp_path: Path, closing: list, safe: bool = True) -> tuple[Setup, str, dict]:
    """A native folder of Setup's state after 3 steps, the state it holds, and the setup moved one step on."""
    acc = make_accelerator(tmp_path, automatic=False)
    closing.append(fastckpt_accelerate.enable(acc))
    setup = Setup(acc)
    for _ in range(3):
        setup.step()
    expected = setup.snapshot()
    path = acc.save_state(str(tmp_path / "checkpoint_3"), safe_serialization=safe)
    closing[-1].wait()
    setup.step()  # away from the saved state
    return setup, path, expected


def _pointers(setup: Setup) -> dict[str, int]:
    return {k: v.data_ptr() for k, v in setup.accelerator.unwrap_model(setup.model).state_dict().items()}


@pytest.mark.parametrize("safe", [True, False])
def test_resume_through_the_fast_path_is_bit_exact(tmp_path, closing, safe):
    setup, path, expected = _saved(tmp_path, closing, safe)
    pointers = _pointers(setup)
    checkpointing = closing[-1]
    assert setup.accelerator.load_state(path) == path
    assert_same({k: expected[k] for k in RESTORED}, {k: v for k, v in setup.snapshot().items() if k in RESTORED})
    stats = checkpointing.last_load_stats
    weights = {"model.safetensors": "into"} if safe else {"pytorch_model.bin": "read"}
    assert stats.files == {**weights, "optimizer.bin": "read", "scheduler.bin": "read", "random_states_0.pkl": "read",
                           "custom_checkpoint_0.pkl": "read"}, stats
    assert stats.fallbacks == {} and stats.verified and stats.kind == "files"
    assert stats.nbytes >= sum(os.path.getsize(os.path.join(path, n)) for n in stats.files)
    if safe:  # read in place: the parameters kept their memory
        assert _pointers(setup) == pointers
    setup.step()  # training writes the mapped optimizer state (copy-on-write): the files stay as they were
    assert verify_checkpoint(LocalStorage(path), path)[1] == []


def test_a_flipped_byte_in_optimizer_bin_is_named_and_nothing_is_loaded(tmp_path, closing):
    setup, path, _ = _saved(tmp_path, closing)
    file = Path(path, "optimizer.bin")
    data = bytearray(file.read_bytes())
    data[-len(data) // 3] ^= 0x10
    file.write_bytes(bytes(data))
    before = setup.snapshot()
    with pytest.raises(IntegrityError, match="optimizer.bin.*nothing was loaded"):
        setup.accelerator.load_state(path)
    assert_same(before, setup.snapshot())


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.bin", "random_states_0.pkl"])
def test_a_truncated_file_is_named_before_anything_loads(tmp_path, closing, name):
    setup, path, _ = _saved(tmp_path, closing)
    file = Path(path, name)
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) - 100)
    before = setup.snapshot()
    with pytest.raises(IntegrityError, match=f"{name}.*the manifest says"):
        setup.accelerator.load_state(path)
    assert_same(before, setup.snapshot())


def _stock_error(acc, path: str, **kwargs) -> BaseException:
    with pytest.raises(Exception) as raised:
        type(acc).load_state(acc, path, **kwargs)  # Accelerate's own, without fastckpt
    return raised.value


def test_a_shape_mismatch_raises_stock_error(tmp_path, closing):
    _, path, _ = _saved(tmp_path, closing)
    acc = make_accelerator(tmp_path / "other", automatic=False)
    Setup(acc, width=8)  # every layer of another shape
    stock = _stock_error(acc, path)
    closing.append(fastckpt_accelerate.enable(acc))
    with pytest.raises(type(stock)) as raised:
        acc.load_state(path)
    assert str(raised.value) == str(stock) and "size mismatch for 0.weight" in str(stock)


def test_missing_keys_raise_as_stock_and_strict_false_loads_as_stock(tmp_path, closing):
    _, path, expected = _saved(tmp_path, closing)
    results = {}
    for fast in (False, True):
        acc = make_accelerator(tmp_path / f"other{fast}", automatic=False)
        setup = Setup(acc, seed=5)
        acc.unwrap_model(setup.model).add_module("extra", nn.Linear(2, 2))  # keys the file lacks
        stock = _stock_error(acc, path)
        if fast:
            closing.append(fastckpt_accelerate.enable(acc))
            with pytest.raises(type(stock)) as raised:
                acc.load_state(path)
            assert str(raised.value) == str(stock) and "Missing key(s) in state_dict" in str(stock)
            acc.load_state(path, strict=False)
            assert closing[-1].last_load_stats.files["model.safetensors"] == "into"
        else:
            type(acc).load_state(acc, path, strict=False)
        results[fast] = setup.snapshot()
    assert_same(results[False], results[True])  # the extra layer kept its weights, the rest restored, as stock
    assert_same(expected["model"], {k: v for k, v in results[True]["model"].items() if not k.startswith("extra")})


class _Tied(nn.Module):
    """An embedding and an output layer sharing one weight (as GPT-2's): the file holds it once."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight


def test_tied_weights_stored_once_are_read_into_the_shared_parameter(tmp_path, closing):
    acc = make_accelerator(tmp_path, automatic=False)
    closing.append(fastckpt_accelerate.enable(acc))
    torch.manual_seed(0)
    model = acc.prepare(_Tied())
    path = acc.save_state(str(tmp_path / "checkpoint_0"))
    closing[-1].wait()
    assert set(load_file(os.path.join(path, "model.safetensors"))) == {"embed.weight", "norm.weight", "norm.bias"}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    other = make_accelerator(tmp_path / "other", automatic=False)
    closing.append(fastckpt_accelerate.enable(other))
    torch.manual_seed(1)
    fresh = other.prepare(_Tied())
    other.load_state(path)
    assert closing[-1].last_load_stats.files["model.safetensors"] == "into"
    assert_same(expected, fresh.state_dict())
    assert fresh.head.weight is fresh.embed.weight  # still one parameter


def test_a_model_with_a_load_hook_takes_stock_reads_after_a_check(tmp_path, closing):
    setup, path, expected = _saved(tmp_path, closing)
    calls = []
    acc_model = setup.accelerator.unwrap_model(setup.model)
    acc_model.register_load_state_dict_post_hook(lambda module, keys: calls.append(1))
    setup.accelerator.load_state(path)
    assert calls == [1]  # stock load_state_dict ran, hooks included
    stats = closing[-1].last_load_stats
    assert stats.files["model.safetensors"] == "stock" and "hooks" in stats.fallbacks["model.safetensors"]
    assert_same(expected["model"], setup.snapshot()["model"])
    Path(path, "model.safetensors").write_bytes(b"\0" * os.path.getsize(os.path.join(path, "model.safetensors")))
    with pytest.raises(IntegrityError, match="model.safetensors.*nothing was loaded"):  # checked before stock reads
        setup.accelerator.load_state(path)


def test_other_load_kwargs_take_stock_reads_after_a_check_of_every_file(tmp_path, closing):
    setup, path, expected = _saved(tmp_path, closing)
    setup.accelerator.load_state(path, load_kwargs={"mmap": True})  # torch.load's own mapping: stock reads
    stats = closing[-1].last_load_stats
    assert stats.files == {} and "mmap" in stats.fallbacks["*"] and "after a check" in stats.fallbacks["*"]
    assert_same({k: expected[k] for k in RESTORED}, {k: v for k, v in setup.snapshot().items() if k in RESTORED})
    file = Path(path, "scheduler.bin")
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="scheduler.bin"):  # the verification pass still runs first
        setup.accelerator.load_state(path, load_kwargs={"mmap": True})


def test_verify_on_load_false_reads_fast_without_checksums(tmp_path, closing):
    _, path, _ = _saved(tmp_path, closing)
    file = Path(path, "model.safetensors")
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    acc = make_accelerator(tmp_path / "other", automatic=False)
    closing.append(fastckpt_accelerate.enable(acc, {"persist": {"verify_on_load": False}}))
    other = Setup(acc, seed=9)
    acc.load_state(path)  # the damage goes unnoticed: nothing is checked (the sizes still are)
    assert_same(load_file(str(file)), other.snapshot()["model"])
    stats = closing[-1].last_load_stats
    assert stats.verified is False and stats.files["model.safetensors"] == "into"


def test_a_stock_folder_loads_through_the_readers_checked_by_zip_crc(tmp_path, closing):
    acc = make_accelerator(tmp_path, automatic=False)
    setup = Setup(acc)
    setup.step()
    folder = str(tmp_path / "stock")
    type(acc).save_state(acc, folder)  # Accelerate's own writer: no manifest
    expected = setup.snapshot()
    closing.append(fastckpt_accelerate.enable(acc))
    setup.step()
    acc.load_state(folder)
    assert_same({k: expected[k] for k in RESTORED}, {k: v for k, v in setup.snapshot().items() if k in RESTORED})
    stats = closing[-1].last_load_stats
    assert stats.kind == "stock" and stats.files["model.safetensors"] == "into"
    assert stats.files["optimizer.bin"] == "read"
    file = Path(folder, "optimizer.bin")
    data = bytearray(file.read_bytes())
    _, offset, size, _ = max(record_spans(str(file)), key=lambda span: span[2])  # the biggest storage record
    data[offset + size // 2] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="optimizer.bin.*CRC-32"):
        acc.load_state(folder)


_DDP_CHILD = textwrap.dedent("""
    import os, sys, torch
    sys.path[:0] = [sys.argv[3], sys.argv[3] + "/tests"]
    import fastckpt_accelerate
    from accelerate_testing import Setup, make_accelerator
    from fastckpt.errors import IntegrityError
    phase, work = sys.argv[1], sys.argv[2]
    acc = make_accelerator(os.path.join(work, "proj"), automatic=False)
    checkpointing = fastckpt_accelerate.enable(acc)
    rank = acc.process_index
    setup = Setup(acc, seed=0 if phase == "save" else 7)
    torch.manual_seed(100 * (phase == "save") + rank)  # each rank its own RNG stream, as with real data
    for _ in range(3):
        setup.step()
    if phase == "save":
        torch.save(setup.snapshot(), os.path.join(work, f"expected.{rank}.pt"))
        acc.save_state(os.path.join(work, "ckpt"))
    else:
        acc.load_state(os.path.join(work, "ckpt"))
        stats = checkpointing.last_load_stats
        try:
            acc.load_state(os.path.join(work, "damaged"))
            damaged = "loaded"
        except IntegrityError as e:
            damaged = str(e)

        def fail_on_rank_1(models, input_dir):
            if rank == 1:
                raise RuntimeError("rank 1's load pre-hook failed")

        acc.register_load_state_pre_hook(fail_on_rank_1)
        try:
            acc.load_state(os.path.join(work, "ckpt"))
            lone = "loaded"
        except RuntimeError as e:
            lone = str(e)
        torch.save({"state": setup.snapshot(), "files": stats.files, "fallbacks": stats.fallbacks,
                    "damaged": damaged, "lone": lone}, os.path.join(work, f"loaded.{rank}.pt"))
    acc.end_training()
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_process_ddp_resume_reads_fast_on_every_rank(tmp_path):
    """Both ranks read through the fast path and restore bit-exact (rank 0's weights, each rank its own RNG);
    a damaged file, and a failure on one rank only, raise on both."""
    child = tmp_path / "child.py"
    child.write_text(_DDP_CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(child)]

    def launch(phase: str) -> None:
        result = subprocess.run(command + [phase, str(tmp_path), str(REPO)], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    launch("save")
    shutil.copytree(tmp_path / "ckpt", tmp_path / "damaged")
    file = tmp_path / "damaged" / "random_states_1.pkl"  # rank 1's own file
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    launch("load")
    expected = [torch.load(tmp_path / f"expected.{r}.pt", weights_only=False) for r in range(2)]
    for rank in range(2):
        loaded = torch.load(tmp_path / f"loaded.{rank}.pt", weights_only=False)
        assert loaded["files"]["model.safetensors"] == "into" and loaded["files"]["optimizer.bin"] == "read"
        assert loaded["files"][f"random_states_{rank}.pkl"] == "read" and loaded["fallbacks"] == {}
        got = loaded["state"]
        # the weights (rank 0's, written once) everywhere; each rank its own RNG streams
        assert_same(expected[0]["model"], got["model"], f"rank{rank}/model")
        for key in ("optimizer", "scheduler", "counter", "torch_rng", "numpy_rng", "python_rng", "step"):
            assert_same(expected[rank][key], got[key], f"rank{rank}/{key}")
        assert "random_states_1.pkl" in loaded["damaged"], loaded["damaged"]  # raised on every rank
        # A failure on one process only is raised on every process (stock would let rank 0 train on alone).
        assert "rank 1's load pre-hook failed" in loaded["lone"], loaded["lone"]
        assert ("on process 1" in loaded["lone"]) == (rank == 0), loaded["lone"]
    assert not torch.equal(expected[0]["torch_rng"], expected[1]["torch_rng"])
