"""The fastckpt command on Accelerate ``checkpoints/`` folders (written by stock ``save_state``, and a folder
with a fastckpt manifest), local and on SeaweedFS S3."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from safetensors.torch import load_file

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.cli import main
from tests.cli_support import flip_record_byte
from tests.accelerate_testing import Setup, make_accelerator, reset_accelerate
from tests.helpers import assert_bit_equal


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> tuple[Path, list[dict[str, Any]]]:
    """Two stock ``save_state`` folders (checkpoint_0 after 2 steps, checkpoint_1 after 4) and the states saved."""
    root = tmp_path_factory.mktemp("accelerate")
    acc = make_accelerator(root)
    setup = Setup(acc)
    snapshots = []
    for _ in range(2):
        setup.step()
        setup.step()
        snapshots.append(setup.snapshot())
        acc.save_state()
    reset_accelerate()
    return root, snapshots


@pytest.fixture
def copy(project, tmp_path) -> Path:
    return Path(shutil.copytree(project[0] / "checkpoints", tmp_path / "checkpoints"))


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def sorted_dict(d: dict[str, Any]) -> dict[str, Any]:
    return dict(sorted(d.items()))


def flip_file(path: Path) -> None:
    path.write_bytes(flip_record_byte(path.read_bytes()))


def test_list(project, capsys) -> None:
    root, _ = project
    for target in (root / "checkpoints", root):  # the checkpoints/ folder, or the project_dir holding it
        code, out, _ = run(["list", str(target), "--json"], capsys)
        assert code == 0
        assert [(r["name"], r["step"], r["status"], r["layout"]) for r in json.loads(out)] == [
            ("checkpoint_0", 2, "committed", "accelerate"), ("checkpoint_1", 4, "committed", "accelerate")]  # training steps


def test_inspect(project, capsys) -> None:
    root, snapshots = project
    code, out, _ = run(["inspect", str(root / "checkpoints" / "checkpoint_1"), "--json"], capsys)
    assert code == 0
    info = json.loads(out)
    tensors = {t["key"]: t for t in info["tensors"]}
    weight = snapshots[1]["model"]["0.weight"]
    assert tensors["model.0.weight"] == {"key": "model.0.weight", "dtype": "float32", "shape": list(weight.shape),
                                         "nbytes": weight.numel() * 4}
    assert tensors["optimizer.state.0.exp_avg"]["dtype"] == "float32"
    assert any(o["key"] == "random_states_0" and o["type"] == "pickle" for o in info["objects"])


def test_verify(copy, capsys) -> None:
    code, out, _ = run(["verify", str(copy / "checkpoint_0"), str(copy / "checkpoint_1")], capsys)
    assert code == 0 and out.count("OK") == 2
    flip_file(copy / "checkpoint_1" / "optimizer.bin")
    model = copy / "checkpoint_0" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:-4])  # truncated
    code, out, err = run(["verify", str(copy / "checkpoint_0"), str(copy / "checkpoint_1")], capsys)
    assert code == 1 and "OK" not in out
    lines = err.splitlines()
    assert len(lines) == 2
    assert str(copy / "checkpoint_1" / "optimizer.bin") in lines[1] and "CRC-32" in lines[1]
    assert str(model) in lines[0]


def test_verify_a_folder_with_a_fastckpt_manifest(copy, capsys) -> None:
    with Checkpointer(CheckpointConfig(root=str(copy))) as ckpt:
        ckpt.save({"model": {"w": torch.ones(64)}}, step=40, name="checkpoint_2").wait()
    code, out, _ = run(["list", str(copy), "--json"], capsys)
    assert code == 0 and json.loads(out)[-1]["step"] == 40  # the manifest's step, not the folder index
    code, _, _ = run(["verify", str(copy / "checkpoint_2")], capsys)
    assert code == 0
    [shard] = (copy / "checkpoint_2").glob("shard-*")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, _, err = run(["verify", str(copy / "checkpoint_2")], capsys)
    assert code == 1 and shard.name in err and "checksum mismatch" in err


def test_gc(copy, capsys) -> None:
    code, out, _ = run(["gc", str(copy), "--keep-last", "1"], capsys)
    assert code == 0 and out.split()[:2] == ["removed", str(copy / "checkpoint_0")]
    assert sorted(p.name for p in copy.iterdir() if not p.name.startswith(".")) == ["checkpoint_1"]


def test_export(project, tmp_path, capsys) -> None:
    root, snapshots = project
    src = str(root / "checkpoints" / "checkpoint_1")
    code, _, _ = run(["export", src, str(tmp_path / "hf"), "--to", "safetensors"], capsys)
    assert code == 0
    assert_bit_equal(sorted_dict(load_file(tmp_path / "hf" / "model.safetensors")),
                     sorted_dict(snapshots[1]["model"]))
    code, _, _ = run(["export", src, str(tmp_path / "all.pt"), "--to", "torch"], capsys)
    assert code == 0
    exported = torch.load(tmp_path / "all.pt", weights_only=True)
    assert_bit_equal(exported["optimizer"], snapshots[1]["optimizer"])
    assert_bit_equal(exported["scheduler"], snapshots[1]["scheduler"])


def test_import(project, tmp_path, capsys) -> None:
    root, snapshots = project
    code, _, err = run(["import", str(root / "checkpoints" / "checkpoint_0"), str(tmp_path / "core"),
                        "--step", "2"], capsys)
    assert code == 0 and "random_states_0.pkl" in err  # numpy RNG state is not weights_only: skipped, said so
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "core"))) as ckpt:
        state = ckpt.load(step=2)
    assert_bit_equal(sorted_dict(state["model"]), sorted_dict(snapshots[0]["model"]))
    assert_bit_equal(state["optimizer"], snapshots[0]["optimizer"])
    assert_bit_equal(state["custom_checkpoint_0"], snapshots[0]["counter"])


def test_every_command_on_s3(project, s3_root, tmp_path, capsys) -> None:
    root, snapshots = project
    fs, base = fsspec.core.url_to_fs(s3_root.url, **s3_root.storage_options)
    fs.put(str(root / "checkpoints"), f"{base}/checkpoints", recursive=True)
    url = f"{s3_root.url}/checkpoints"
    opts = ["--storage-options", json.dumps(s3_root.storage_options)]
    code, out, _ = run(["list", url, "--json", *opts], capsys)
    assert code == 0
    assert [(r["name"], r["where"]) for r in json.loads(out)] == [("checkpoint_0", "s3"), ("checkpoint_1", "s3")]
    code, out, _ = run(["inspect", f"{url}/checkpoint_1", "--json", *opts], capsys)
    assert code == 0 and any(t["key"] == "model.0.weight" for t in json.loads(out)["tensors"])
    code, _, _ = run(["verify", f"{url}/checkpoint_0", f"{url}/checkpoint_1", *opts], capsys)
    assert code == 0
    code, _, _ = run(["export", f"{url}/checkpoint_1", str(tmp_path / "hf"), "--to", "safetensors", *opts], capsys)
    assert code == 0
    assert_bit_equal(sorted_dict(load_file(tmp_path / "hf" / "model.safetensors")),
                     sorted_dict(snapshots[1]["model"]))
    code, _, _ = run(["import", f"{url}/checkpoint_1", f"{s3_root.url}/core", "--step", "4", *opts], capsys)
    assert code == 0
    with Checkpointer(CheckpointConfig(root=f"{s3_root.url}/core", storage_options=s3_root.storage_options)) as ckpt:
        assert_bit_equal(ckpt.load(step=4)["optimizer"], snapshots[1]["optimizer"])
    bad = tmp_path / "optimizer.bin"
    shutil.copy(root / "checkpoints" / "checkpoint_1" / "optimizer.bin", bad)
    flip_file(bad)
    fs.put_file(str(bad), f"{base}/checkpoints/checkpoint_1/optimizer.bin")
    code, _, err = run(["verify", f"{url}/checkpoint_1", *opts], capsys)
    assert code == 1 and f"{url}/checkpoint_1/optimizer.bin" in err
    code, out, _ = run(["gc", url, "--keep-last", "1", *opts], capsys)
    assert code == 0 and out.split()[:2] == ["removed", f"{url}/checkpoint_0"]
    assert not fs.exists(f"{base}/checkpoints/checkpoint_0/model.safetensors")
    assert fs.exists(f"{base}/checkpoints/checkpoint_1/model.safetensors")


def test_native_folder_written_by_fastckpt_accelerate(tmp_path, capsys) -> None:
    """A ``checkpoint_N/`` written by fastckpt_accelerate (stock files + manifest.json) is an Accelerate folder to
    every command: inspect, export and import read its files (they once took it for a core checkpoint and
    refused), verify checks the manifest's CRC32C of each file."""
    import fastckpt_accelerate

    acc = make_accelerator(tmp_path / "proj")
    setup = Setup(acc)
    hook = fastckpt_accelerate.enable(acc)
    try:
        setup.step()
        saved = setup.snapshot()
        acc.save_state()
        hook.wait()
    finally:
        hook.close()
        reset_accelerate()
    folder = tmp_path / "proj" / "checkpoints" / "checkpoint_0"
    assert (folder / "manifest.json").is_file() and (folder / "model.safetensors").is_file()
    code, out, _ = run(["list", str(tmp_path / "proj"), "--json"], capsys)
    assert code == 0 and [(r["name"], r["step"]) for r in json.loads(out)] == [("checkpoint_0", 1)]  # the training step

    code, out, _ = run(["inspect", str(folder), "--json"], capsys)
    assert code == 0 and "accelerate" in out
    code, _, err = run(["export", str(folder), str(tmp_path / "w.safetensors"), "--to", "safetensors"], capsys)
    assert code == 0, err
    assert_bit_equal(sorted_dict(load_file(tmp_path / "w.safetensors")), sorted_dict(saved["model"]))
    code, _, err = run(["import", str(folder), str(tmp_path / "core"), "--step", "3"], capsys)
    assert code == 0, err
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "core"))) as ckpt:
        assert_bit_equal(sorted_dict(ckpt.load(3)["model"]), sorted_dict(saved["model"]))
    assert run(["verify", str(folder)], capsys)[0] == 0
    flip_file(folder / "optimizer.bin")
    code, _, err = run(["verify", str(folder)], capsys)
    assert code == 1 and "optimizer.bin" in err


@pytest.mark.parametrize("fast", [False, True], ids=["stock", "fastckpt_accelerate"])
def test_list_shows_the_optimizer_steps_without_gradient_accumulation(tmp_path, capsys, fast) -> None:
    """Issue 55, item 7: ``list`` showed STEP 0 for every Accelerate checkpoint: it read ``Accelerator.step``, which
    only ``accumulate()`` advances (and which restarts each epoch). The step is the optimizer's count."""
    import fastckpt_accelerate

    acc = make_accelerator(tmp_path / "proj")
    setup = Setup(acc)
    hook = fastckpt_accelerate.enable(acc) if fast else None
    try:
        for _ in range(2):
            for _ in range(3):  # a plain loop, as the README's: no accelerator.accumulate()
                loss = setup.model(torch.randn(8, setup.width)).square().mean()
                acc.backward(loss)
                setup.optimizer.step()
                setup.optimizer.zero_grad()
            acc.save_state()
        if hook is not None:
            hook.wait()
    finally:
        if hook is not None:
            hook.close()
        reset_accelerate()
    code, out, _ = run(["list", str(tmp_path / "proj"), "--json"], capsys)
    assert code == 0
    assert [(r["name"], r["step"]) for r in json.loads(out)] == [("checkpoint_0", 3), ("checkpoint_1", 6)]

