"""The fastckpt command on Lightning dirpaths: .ckpt files written by FastCheckpointIO, fastckpt 0.1's pointer
layout, local and on SeaweedFS S3; exported checkpoints resume in a stock Lightning process without fastckpt."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.cli import main
from fastckpt_lightning import FastCheckpointIO
from cli_support import flip_record_byte
from helpers import assert_bit_equal
from lightning_support import ResumableBatches, TinyModule, make_trainer

REPO = Path(__file__).resolve().parents[1]
NAMES = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]

# Run by a fresh interpreter that never imports fastckpt: stock Lightning resumes from the exported file.
STOCK_RESUME = r'''
import json, sys
import lightning.pytorch as pl
import torch
from torch import nn

class TinyModule(pl.LightningModule):  # the same layers and optimizer as tests/lightning_support.py
    def __init__(self, batchnorm=False, manual=False, width=64):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, width), nn.Identity(), nn.Tanh(), nn.Linear(width, 1))
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}

class Batches:  # a stateful loader, as tests/lightning_support.py's ResumableBatches (the checkpoint holds its state)
    def __init__(self):
        self.batches = [(torch.randn(4, 16), torch.randn(4, 1)) for _ in range(4)]
        self.start = self.handed_out = 0
    def __len__(self):
        return len(self.batches)
    def __iter__(self):
        start, self.start = self.start, 0
        for i in range(start, len(self.batches)):
            self.handed_out = i + 1
            yield self.batches[i]
    def state_dict(self):
        return {"handed_out": self.handed_out}
    def load_state_dict(self, state):
        self.start = state["handed_out"] % len(self.batches)

class Probe(pl.Callback):
    def on_train_start(self, trainer, module):
        saved = torch.load(sys.argv[1], weights_only=True)
        self.start = trainer.global_step
        self.same = all(torch.equal(v, saved["state_dict"][k]) for k, v in module.state_dict().items())

probe = Probe()
data = Batches()
trainer = pl.Trainer(accelerator="cpu", max_steps=8, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[probe])
trainer.fit(TinyModule(), data, ckpt_path=sys.argv[1])
print(json.dumps({"start": probe.start, "same": probe.same, "end": trainer.global_step,
                  "fastckpt": any(m.startswith("fastckpt") for m in sys.modules)}))
'''


@pytest.fixture(scope="module")
def dirpath(tmp_path_factory) -> Path:
    """Six steps of training, a checkpoint every two and last.ckpt, written by FastCheckpointIO."""
    out = tmp_path_factory.mktemp("lightning") / "ckpts"
    plugin = FastCheckpointIO(persist={"fsync": False})
    checkpoints = ModelCheckpoint(dirpath=str(out), every_n_train_steps=2, save_top_k=-1, save_last=True)
    make_trainer([checkpoints], plugin, max_steps=6).fit(TinyModule(), ResumableBatches())
    assert sorted(os.listdir(out)) == NAMES  # each file's health record is an extended attribute of it
    return out


@pytest.fixture
def copy(dirpath, tmp_path) -> Path:
    return Path(shutil.copytree(dirpath, tmp_path / "ckpts"))


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def fast_load(path: str, **options: Any) -> dict[str, Any]:
    return FastCheckpointIO(storage_options=options or None).load_checkpoint(path, weights_only=True)


def test_list(copy, capsys) -> None:
    torn = (copy / "epoch=1-step=6.ckpt").read_bytes()
    (copy / "epoch=2-step=8.ckpt").write_bytes(torn[: len(torn) // 2])  # a write that stopped part way
    code, out, _ = run(["list", str(copy), "--json"], capsys)
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)}
    assert [(rows[n]["step"], rows[n]["epoch"], rows[n]["status"]) for n in NAMES] == [
        (2, 0, "committed"), (4, 0, "committed"), (6, 1, "committed"), (6, 1, "committed")]
    assert rows["epoch=2-step=8.ckpt"]["status"] == "torn"
    assert all(r["layout"] == "lightning" and r["where"] == "local" for r in rows.values())


def test_gc_keeps_the_newest_and_last_and_never_removes_torn_files(copy, capsys) -> None:
    torn = copy / "epoch=9-step=99.ckpt"  # a torn file fastckpt cannot prove it wrote (its saves appear by rename)
    torn.write_bytes((copy / "last.ckpt").read_bytes()[:100])
    os.utime(torn, (1, 1))
    argv = ["gc", str(copy), "--keep-last", "1", "--grace-s", "60"]
    code, out, _ = run([*argv, "--dry-run"], capsys)
    assert code == 0 and out.count("would remove") == 2 and "epoch=9-step=99.ckpt" not in out
    assert sorted(os.listdir(copy)) == sorted([*NAMES, torn.name])  # a dry run writes nothing, not even the lock
    code, out, _ = run(argv, capsys)
    assert code == 0 and out.count("removed") == 2
    assert sorted(n for n in os.listdir(copy) if n.endswith(".ckpt")) == sorted([torn.name, "epoch=1-step=6.ckpt",
                                                                                 "last.ckpt"])


def test_inspect(dirpath, capsys) -> None:
    code, out, _ = run(["inspect", str(dirpath / "last.ckpt"), "--json"], capsys)
    assert code == 0
    info = json.loads(out)
    tensors = {t["key"]: t for t in info["tensors"]}
    assert tensors["state_dict.net.0.weight"] == {"key": "state_dict.net.0.weight", "dtype": "float32",
                                                  "shape": [64, 16], "nbytes": 64 * 16 * 4}
    assert any(k.startswith("optimizer_states.0.state.") for k in tensors)
    assert {"key": "global_step", "type": "int", "value": "6"} in info["objects"]


def test_inspect_shortens_long_keys_to_the_terminal(dirpath, capsys, monkeypatch) -> None:
    """Issue 55, item 7: ModelCheckpoint's state key (``callbacks.ModelCheckpoint{'monitor': None, ...}.x``, ~150
    characters) made the KEY column that wide. Keys are shortened to leave the other columns 40 characters of the
    terminal (the ``{...}`` collapsed first, then middle segments); the leaf stays; ``--json`` keeps them whole."""
    monkeypatch.setenv("COLUMNS", "100")
    code, out, _ = run(["inspect", str(dirpath / "last.ckpt"), "--json"], capsys)
    full = [o["key"] for o in json.loads(out)["objects"]]
    assert code == 0 and any(len(k) > 100 and k.startswith("callbacks.ModelCheckpoint{") for k in full)
    code, out, _ = run(["inspect", str(dirpath / "last.ckpt")], capsys)
    assert code == 0
    lines = out.splitlines()
    tables = [line for line in lines[1:] if line and not line.startswith("(")]
    widths = {line.index("  ") for line in tables if "  " in line}  # where the KEY column ends
    assert max(widths) <= 60, max(widths)
    assert any(line.startswith("callbacks.ModelCheckpoint{...}.best_model_path ") for line in tables)
    assert lines[-1] == "(keys longer than 60 characters are shortened here; --json prints them whole)"
    assert any(line.startswith("global_step ") for line in tables)


def test_verify_a_dirpath_verifies_every_file(copy, capsys) -> None:
    """Issue 55, item 7: ``verify DIRPATH`` checks each checkpoint ``list`` shows there."""
    code, out, err = run(["verify", str(copy)], capsys)
    assert code == 0, err
    assert out.splitlines() == [f"OK  {copy / n}" for n in NAMES]


def test_verify_catches_a_flipped_byte(copy, capsys) -> None:
    code, out, _ = run(["verify", *(str(copy / n) for n in NAMES)], capsys)
    assert code == 0 and out.count("OK") == 4
    bad = copy / "epoch=0-step=4.ckpt"
    bad.write_bytes(flip_record_byte(bad.read_bytes()))
    code, out, err = run(["verify", *(str(copy / n) for n in NAMES)], capsys)
    assert code == 1 and out.count("OK") == 3
    assert err.count("\n") == 1 and str(bad) in err and "CRC-32" in err


def _stock_resume(path: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", STOCK_RESUME, str(path)], capture_output=True, text=True,
                          env=env, cwd=path.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_export_torch_resumes_in_stock_lightning(dirpath, tmp_path, capsys) -> None:
    out = tmp_path / "exported.ckpt"
    code, _, _ = run(["export", str(dirpath / "epoch=1-step=6.ckpt"), str(out), "--to", "torch"], capsys)
    assert code == 0
    assert_bit_equal(torch.load(out, weights_only=True), fast_load(str(dirpath / "epoch=1-step=6.ckpt")))
    assert _stock_resume(out) == {"start": 6, "same": True, "end": 8, "fastckpt": False}


def test_reading_lightning_checkpoints_never_imports_lightning(dirpath, tmp_path) -> None:
    code = ("import sys\nfrom fastckpt.cli import main\nd, out = sys.argv[1], sys.argv[2]\n"
            "for argv in (['list', d], ['inspect', d + '/last.ckpt'], ['verify', d + '/last.ckpt'],\n"
            "             ['export', d + '/last.ckpt', out, '--to', 'torch']):\n"
            "    assert main(argv) == 0, argv\n"
            "bad = [m for m in ('lightning', 'pytorch_lightning', 'accelerate', 'fastckpt_lightning') if m in sys.modules]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code, str(dirpath), str(tmp_path / "out.ckpt")], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _pointer_layout(dirpath: Path, folder: Path) -> Path:
    """A checkpoint in fastckpt 0.1's layout: a JSON pointer naming a core folder beside it."""
    checkpoint = torch.load(dirpath / "epoch=1-step=6.ckpt", weights_only=True)
    part = "epoch=1-step=6.ckpt.0123abcd.fastckpt"
    with Checkpointer(CheckpointConfig(root=str(folder))) as ckpt:
        ckpt.save(checkpoint, step=6, name=part).wait()
    pointer = folder / "epoch=1-step=6.ckpt"
    pointer.write_text(json.dumps({"format": "fastckpt-lightning-pointer", "version": 1, "parts": [part],
                                   "step": 6}))
    return pointer


def test_old_pointer_layout_converts_to_a_stock_checkpoint(dirpath, tmp_path, capsys) -> None:
    old = _pointer_layout(dirpath, tmp_path / "old")
    code, out, _ = run(["list", str(old.parent), "--json"], capsys)
    assert code == 0 and [(r["step"], r["layout"]) for r in json.loads(out)] == [(6, "lightning-0.1-pointer")]
    code, out, _ = run(["verify", str(old)], capsys)
    assert code == 0
    new = tmp_path / "new.ckpt"
    code, _, _ = run(["export", str(old), str(new), "--to", "torch"], capsys)
    assert code == 0
    assert_bit_equal(torch.load(new, weights_only=True), fast_load(str(old)))
    assert _stock_resume(new) == {"start": 6, "same": True, "end": 8, "fastckpt": False}


def test_export_safetensors_takes_the_state_dict(dirpath, tmp_path, capsys) -> None:
    code, _, _ = run(["export", str(dirpath / "last.ckpt"), str(tmp_path / "hf"), "--to", "safetensors"], capsys)
    assert code == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    expected = fast_load(str(dirpath / "last.ckpt"))["state_dict"]
    assert_bit_equal(dict(sorted(exported.items())), dict(sorted(expected.items())))


def test_import_ckpt_into_a_core_root(dirpath, tmp_path, capsys) -> None:
    code, _, _ = run(["import", str(dirpath / "epoch=0-step=2.ckpt"), str(tmp_path / "core"), "--step", "2"], capsys)
    assert code == 0
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "core"))) as ckpt:
        assert_bit_equal(ckpt.load(step=2), fast_load(str(dirpath / "epoch=0-step=2.ckpt")))


def test_every_command_on_s3(dirpath, s3_root, tmp_path, capsys) -> None:
    fs, base = fsspec.core.url_to_fs(s3_root.url, **s3_root.storage_options)
    for name in NAMES:
        fs.pipe_file(f"{base}/{name}", (dirpath / name).read_bytes())
    opts = ["--storage-options", json.dumps(s3_root.storage_options)]
    code, out, _ = run(["list", s3_root.url, "--json", *opts], capsys)
    assert code == 0
    assert [(r["name"], r["step"], r["where"]) for r in json.loads(out)] == [
        ("epoch=0-step=2.ckpt", 2, "s3"), ("epoch=0-step=4.ckpt", 4, "s3"),
        ("epoch=1-step=6.ckpt", 6, "s3"), ("last.ckpt", 6, "s3")]
    code, out, _ = run(["inspect", f"{s3_root.url}/last.ckpt", "--json", *opts], capsys)
    assert code == 0 and any(t["key"] == "state_dict.net.0.weight" for t in json.loads(out)["tensors"])
    out_path = tmp_path / "from-s3.ckpt"
    code, _, _ = run(["export", f"{s3_root.url}/last.ckpt", str(out_path), "--to", "torch", *opts], capsys)
    assert code == 0
    assert_bit_equal(torch.load(out_path, weights_only=True), fast_load(str(dirpath / "last.ckpt")))
    code, _, _ = run(["import", f"{s3_root.url}/last.ckpt", f"{s3_root.url}-core", "--step", "6", *opts], capsys)
    assert code == 0
    code, _, _ = run(["verify", f"{s3_root.url}/last.ckpt", f"{s3_root.url}-core/step-000000006", *opts], capsys)
    assert code == 0
    code, out, _ = run(["gc", s3_root.url, "--keep-last", "2", *opts], capsys)
    assert code == 0 and out.split() == ["removed", f"{s3_root.url}/epoch=0-step=2.ckpt", "(step", "2,", "retention)"]
    assert not fs.exists(f"{base}/epoch=0-step=2.ckpt") and fs.exists(f"{base}/epoch=0-step=4.ckpt")
    fs.pipe_file(f"{base}/last.ckpt", flip_record_byte((dirpath / "last.ckpt").read_bytes()))
    code, _, err = run(["verify", f"{s3_root.url}/last.ckpt", *opts], capsys)
    assert code == 1 and f"{s3_root.url}/last.ckpt" in err and "CRC-32" in err


def test_gc_removes_the_temporary_files_of_dead_saves_only(copy, capsys) -> None:
    """A save killed before its rename leaves `.NAME.fastckpt-tmp-*` and its marker; gc removes both once unchanged
    for the grace period, and leaves a fresh one (a live save may still be writing it), a file merely named like
    one (no marker: not fastckpt's) and every checkpoint alone."""
    from fastckpt.storage.tempmark import mark_bytes

    dead = copy / ".epoch=2-step=8.ckpt.fastckpt-tmp-4242-777"
    shared = copy / ".epoch=2-step=9.ckpt.fastckpt-tmp-0a1b2c3d4e5f"
    live = copy / ".epoch=3-step=10.ckpt.fastckpt-tmp-4243-778"
    named = copy / ".epoch=3-step=11.ckpt.fastckpt-tmp-4244-779"
    marks = [Path(f"{f}.fastckpt-mark") for f in (dead, shared, live)]
    for f, m in zip((dead, shared, live), marks):
        m.write_bytes(mark_bytes(f.name))
    for f in (dead, shared, live, named):
        f.write_bytes(b"\0" * 100)
    for f in (dead, shared, named, *marks[:2]):
        os.utime(f, (1, 1))
    argv = ["gc", str(copy), "--grace-s", "60"]
    code, out, _ = run([*argv, "--dry-run"], capsys)
    assert code == 0 and out.count("(temporary file of a dead save)") == 4 and dead.exists()
    code, out, _ = run(argv, capsys)
    assert code == 0 and str(dead) in out and str(shared) in out
    assert not dead.exists() and not shared.exists() and not any(m.exists() for m in marks[:2])
    assert live.exists() and marks[2].exists() and named.exists()
    assert all((copy / n).exists() for n in NAMES)

def test_gc_leaves_exactly_the_kept_files(copy, capsys) -> None:
    code, _, _ = run(["gc", str(copy), "--keep-last", "1", "--grace-s", "60"], capsys)
    assert code == 0
    assert sorted(os.listdir(copy)) == [".fastckpt.lock", "epoch=1-step=6.ckpt", "last.ckpt"]
