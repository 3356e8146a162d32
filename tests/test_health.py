"""Health of every checkpoint (issue 25, item 2) in the core: statistics measured by the background workers, the
newest healthy checkpoint found and kept, and a torch file's record (an extended attribute of the
file, a sidecar on an object store) unseen by torch.load."""
from __future__ import annotations

import json
import math
import os
import threading
import uuid
from pathlib import Path

import pytest
import torch

import fastckpt.format.healthpass as healthpass
from fastckpt import CheckpointConfig, Checkpointer, CheckpointNotFoundError
from fastckpt.format.health import HEALTH_ATTR, SIDECAR_SUFFIX, tensor_health
from helpers import assert_bit_equal, clone_state
from tests import passpaths


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()


def _run(root: Path, steps: int, nan_at: int | None, **cfg) -> tuple[Checkpointer, dict[int, dict]]:
    """Train ``steps`` steps, saving after each; from ``nan_at`` on a weight holds a NaN (a diverged run)."""
    model, opt = _model()
    ckpt = Checkpointer(CheckpointConfig(root=str(root), **cfg))
    ckpt.watch(opt)
    saved = {}
    for step in range(steps):
        _train(model, opt)
        if nan_at is not None and step >= nan_at:
            with torch.no_grad():
                model[0].weight[1, 2] = float("nan")
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        saved[step] = clone_state(state)
        ckpt.save(state, step)
    ckpt.wait()
    return ckpt, saved


def test_nan_at_step_n_latest_healthy_is_the_checkpoint_before(tmp_path: Path) -> None:
    ckpt, saved = _run(tmp_path, 6, nan_at=3)
    try:
        assert ckpt.latest() == 5
        assert ckpt.latest(healthy=True) == 2
        assert [i.healthy for i in ckpt.list()] == [True, True, True, False, False, False]
        assert_bit_equal(ckpt.load(healthy=True), saved[2])
        with pytest.raises(CheckpointNotFoundError, match="no healthy committed checkpoint at step 4"):
            ckpt.load(step=4, healthy=True)
    finally:
        ckpt.close()
    doc = json.loads((tmp_path / "step-000000003" / "manifest.json").read_text())
    assert doc["health"]["healthy"] is False and doc["health"]["nan"] == 1
    assert doc["health"]["tensors"]["model/0.weight"]["nan"] == 1


def test_statistics_are_exact_and_measured_on_the_staged_copy() -> None:
    t = torch.tensor([1.5, -4.0, float("nan"), float("inf"), float("-inf"), 3.0], dtype=torch.float32)
    h = tensor_health(t.view(torch.uint8), torch.float32)
    assert (h["nan"], h["inf"], h["absmax"]) == (1, 2, 4.0)
    assert h["l2"] == math.sqrt(1.5 ** 2 + 4.0 ** 2 + 3.0 ** 2)
    big = torch.full((3_000_000,), 1e-4, dtype=torch.float32)  # a plain float32 sum drifts here (~1e-4)
    h = tensor_health(big.view(torch.uint8), torch.float32)
    exact = big.double().norm().item()
    assert abs(h["l2"] - exact) / exact < 1e-6 and abs(big.norm().item() - exact) / exact > 1e-5
    huge = torch.full((1000,), 1e30, dtype=torch.float32)  # squares overflow float32: measured in float64
    assert tensor_health(huge.view(torch.uint8), torch.float32)["l2"] == huge.double().norm().item()
    for dtype in (torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64, torch.uint8):
        x = (torch.arange(-5, 5) if dtype is not torch.bool else torch.arange(10) % 2).to(dtype)
        h = tensor_health(x.reshape(-1).view(torch.uint8), dtype)
        assert h["nan"] == h["inf"] == 0
        ref = torch.view_as_real(x).double() if x.is_complex() else x.double()
        assert h["absmax"] == ref.abs().max().item() and abs(h["l2"] - ref.norm().item()) < 1e-9
    a, b = torch.randn(10_000), torch.randn(10_000)
    assert tensor_health(a.view(torch.uint8), torch.float32)["fp"] == tensor_health(
        a.clone().view(torch.uint8), torch.float32)["fp"]
    assert tensor_health(a.view(torch.uint8), torch.float32)["fp"] != tensor_health(
        b.view(torch.uint8), torch.float32)["fp"]


@pytest.mark.parametrize("path", passpaths.PATHS)
def test_statistics_run_on_fastckpt_worker_threads_never_the_training_thread(tmp_path: Path, monkeypatch,
                                                                              path: str) -> None:
    """The statistics (format/batchpass.py's pass, or format/healthpass.py's blocked one) run on the copy thread
    (``staging.crc_in_copy``, lazy copies) or an I/O worker (the rest), never on the training thread."""
    passpaths.use(monkeypatch, path)
    threads = passpaths.measuring_threads(monkeypatch)
    ckpt, _ = _run(tmp_path, 2, nan_at=None)
    ckpt.close()
    assert threads and "MainThread" not in threads
    assert all(n.startswith(("fastckpt-io", "fastckpt-boost", "fastckpt-copy")) for n in threads), threads


def test_retention_never_deletes_the_newest_healthy_checkpoint(tmp_path: Path) -> None:
    ckpt, _ = _run(tmp_path / "count", 7, nan_at=3, retention={"keep_last": 2})
    names = [i.name for i in ckpt.list()]
    ckpt.close()
    assert names == ["step-000000002", "step-000000005", "step-000000006"]  # 2: the newest healthy one

    ckpt, _ = _run(tmp_path / "delete", 7, nan_at=3, retention={"keep_last": 2, "unhealthy": "delete"})
    names = [i.name for i in ckpt.list()]
    ckpt.close()
    assert names == ["step-000000001", "step-000000002", "step-000000006"]  # 6: the newest is never removed

    ckpt, _ = _run(tmp_path / "keep", 6, nan_at=3, retention={"keep_last": 2, "unhealthy": "keep"})
    names = [i.name for i in ckpt.list()]
    ckpt.close()
    assert names == ["step-000000001", "step-000000002", "step-000000003", "step-000000004", "step-000000005"]


def test_unmeasured_checkpoints_stay_readable_and_are_never_called_healthy(tmp_path: Path) -> None:
    ckpt, saved = _run(tmp_path, 2, nan_at=None, health={"enabled": False})
    try:
        assert [i.healthy for i in ckpt.list()] == [None, None]
        assert "health" not in json.loads((tmp_path / "step-000000001" / "manifest.json").read_text())
        assert_bit_equal(ckpt.load(), saved[1])
        assert ckpt.latest(healthy=True) is None
        with pytest.raises(CheckpointNotFoundError, match="2 found, 0 with NaN/Inf values.*not measured"):
            ckpt.load(healthy=True)
    finally:
        ckpt.close()


def test_crafted_health_field_hides_the_checkpoint_with_a_warning(tmp_path: Path, caplog) -> None:
    ckpt, _ = _run(tmp_path, 2, nan_at=None)
    ckpt.close()
    mpath = tmp_path / "step-000000001" / "manifest.json"
    doc = json.loads(mpath.read_text())
    doc["health"] = {"healthy": True, "nan": 5}  # healthy, yet counting NaNs
    mpath.write_text(json.dumps(doc))
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as again:
        assert [i.step for i in again.list()] == [0]
        assert again.latest(healthy=True) == 0
    assert "says healthy but counts NaN" in caplog.text


def test_torch_file_health_is_an_extended_attribute_unseen_by_torch_load(tmp_path: Path) -> None:
    model, opt = _model()
    _train(model, opt)
    with torch.no_grad():
        model[2].bias[0] = float("inf")
    state = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "epoch": 1}
    ref = clone_state(state)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        handle = ckpt.save_file(state, "epoch=1.ckpt", step=7)
        info = handle.wait()
    assert info.healthy is False
    assert sorted(os.listdir(tmp_path)) == ["epoch=1.ckpt"]  # no sidecar: the record is the file's own attribute
    assert_bit_equal(torch.load(tmp_path / "epoch=1.ckpt", weights_only=True), ref)
    record = os.getxattr(tmp_path / "epoch=1.ckpt", HEALTH_ATTR)
    assert len(record) < 512  # a summary, never the per-tensor table: ext4 keeps ~4 KB of attributes per file
    side = json.loads(record)
    assert side["step"] == 7 and side["size"] == (tmp_path / "epoch=1.ckpt").stat().st_size
    assert side["health"]["inf"] == 1 and side["health"]["healthy"] is False and "tensors" not in side["health"]
    # 4 parameters, each with Adam's exp_avg, exp_avg_sq and step; a digest of their fingerprints
    assert side["health"]["count"] == 16 and len(side["health"]["fp"]) == 16


def test_torch_file_statistics_use_each_storage_dtype(tmp_path: Path) -> None:
    # an object store keeps no attributes: the record, per-tensor table included, is a hidden sidecar there
    import fsspec

    root = f"memory://fastckpt-{uuid.uuid4().hex}"
    state = {"w": torch.tensor([3.0, -5.0], dtype=torch.bfloat16), "n": torch.tensor([-7, 2], dtype=torch.int64)}
    with Checkpointer(CheckpointConfig(root=root)) as ckpt:
        ckpt.save_file(state, "a.ckpt").wait()
    with fsspec.open(f"{root}/.a.ckpt{SIDECAR_SUFFIX}", "rb") as f:
        side = json.loads(f.read())["health"]["tensors"]
    assert side["w"]["absmax"] == 5.0 and side["n"]["absmax"] == 7.0 and side["n"]["l2"] == math.sqrt(53)


def test_fastckpt_list_shows_a_health_column(tmp_path: Path, capsys) -> None:
    from fastckpt.cli import main

    ckpt, _ = _run(tmp_path / "core", 4, nan_at=2)
    ckpt.close()
    assert main(["list", str(tmp_path / "core"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["health"]) for r in rows][:3] == [(0, "ok"), (1, "ok"), (2, "NaN=1 Inf=0")]
    assert rows[3]["health"].startswith("NaN=")  # the NaN spread through the next step
    model, opt = _model()
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "lightning"))) as files:
        files.save_file({"state_dict": model.state_dict(), "global_step": 3}, "epoch=0-step=3.ckpt", step=3)
    torch.save({"state_dict": model.state_dict()}, tmp_path / "lightning" / "epoch=0-step=4.ckpt")  # stock's
    assert main(["list", str(tmp_path / "lightning")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[6] == "HEALTH"
    assert [line.split()[-2] for line in lines[1:]] == ["ok", "-"]  # HEALTH, then NAME


def test_fastckpt_gc_of_a_lightning_folder_keeps_the_newest_healthy_file(tmp_path: Path, capsys) -> None:
    from fastckpt.cli import main

    model, _ = _model()
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as files:
        for step in range(1, 5):
            if step == 3:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
            files.save_file({"state_dict": model.state_dict(), "global_step": step}, f"epoch=0-step={step}.ckpt",
                            step=step)
    assert main(["gc", str(tmp_path), "--keep-last", "1", "--grace-s", "60"]) == 0
    left = sorted(n for n in os.listdir(tmp_path) if n.endswith(".ckpt"))
    assert left == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]  # 2: the newest healthy; 4: the newest
    assert sorted(os.listdir(tmp_path)) == [".fastckpt.lock", *left]  # no record of a removed file outlives it


def _contradict(manifest: Path, how: str) -> None:
    """Edit the health record of ``manifest`` (a healthy one) so that it contradicts itself, as ``how`` says."""
    doc = json.loads(manifest.read_text())
    health = doc["health"]
    assert health["healthy"] is True
    if how == "incomplete":
        health["complete"] = False
    elif how == "row-nan":
        health["tensors"]["model/0.weight"]["nan"] = 5  # the totals still say 0
    elif how == "row-inf":
        health["tensors"]["model/0.weight"]["inf"] = 3  # an Inf among 128 values: a diverged tensor
        health["inf"] = 3
    elif how == "totals":
        health["inf"] = 4  # no row counts an Inf
    elif how == "no-complete":
        del health["complete"]
    manifest.write_text(json.dumps(doc))


@pytest.mark.parametrize("how", ["incomplete", "row-nan", "row-inf", "totals", "no-complete"])
def test_a_health_record_that_contradicts_itself_is_unknown_never_healthy(tmp_path: Path, capsys, how: str) -> None:
    from fastckpt.cli import main

    ckpt, saved = _run(tmp_path, 3, nan_at=None)
    ckpt.close()
    for step in (1, 2):
        _contradict(tmp_path / f"step-00000000{step}" / "manifest.json", how)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as again:
        assert [i.healthy for i in again.list()] == [True, None, None]  # listed all the same, health unknown
        assert again.latest(healthy=True) == 0
        assert_bit_equal(again.load(healthy=True), saved[0])
        with pytest.raises(CheckpointNotFoundError, match="contradicts itself"):
            again.load(step=2, healthy=True)
    assert main(["list", str(tmp_path), "--json"]) == 0
    assert [r["health"] for r in json.loads(capsys.readouterr().out)] == ["ok", "unknown", "unknown"]


def test_a_file_record_that_contradicts_itself_is_unknown(tmp_path: Path, capsys) -> None:
    from fastckpt.cli import main
    from fastckpt_lightning import find_healthy_checkpoint

    model, _ = _model()
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as files:
        for step in (1, 2):
            files.save_file({"state_dict": model.state_dict(), "global_step": step}, f"epoch=0-step={step}.ckpt",
                            step=step)
    newest = tmp_path / "epoch=0-step=2.ckpt"
    record = json.loads(os.getxattr(newest, HEALTH_ATTR))
    record["health"]["complete"] = False  # still "healthy": true
    os.setxattr(newest, HEALTH_ATTR, json.dumps(record).encode())
    assert find_healthy_checkpoint(str(tmp_path)) == str(tmp_path / "epoch=0-step=1.ckpt")
    assert main(["list", str(tmp_path), "--json"]) == 0
    assert [r["health"] for r in json.loads(capsys.readouterr().out)] == ["ok", "unknown"]
