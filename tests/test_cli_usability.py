"""The command as a person uses it (issue 23, item 12): progress in bytes that moves on one large checkpoint,
an ``inspect`` table with one dtype spelling and human sizes, the step a checkpoint records (Accelerate's
training step, a ``.ckpt``'s ``global_step`` for ``import``), control characters never reaching the
terminal, and a checkpoint deleted part way shown as damaged by ``list`` and explained by ``load()``."""
from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.cli import main
from fastckpt.errors import IntegrityError
from tests.helpers import assert_bit_equal

BIG = 10_000_000  # float32 elements: 40 MB, more than two read pieces (16 MB) and two CRC steps


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def percents(err: str, what: str) -> list[int]:
    """The percentages of the progress lines of ``what`` (a verb) in ``err``."""
    return [int(p) for p in re.findall(rf"^{what} .*?\((\d+)%\)$", err, re.MULTILINE)]


def moved(values: list[int]) -> bool:
    """Progress that moved: at least two values strictly between 0 and 100, increasing, ending at or near 100."""
    inside = [v for v in values if 0 < v < 100]
    return len(inside) >= 2 and values == sorted(values) and values[-1] >= 95


def save_core(root: Path, *steps: int, big: bool = False) -> dict[int, dict[str, Any]]:
    states = {}
    with Checkpointer(CheckpointConfig(root=str(root), staging={"mode": "eager"})) as ckpt:
        for step in steps:
            g = torch.Generator().manual_seed(step)
            states[step] = {"model": {"w": torch.randn(BIG if big else 64, generator=g),
                                      "b": torch.randn(4, generator=g).bfloat16()}, "step": step}
            ckpt.save(states[step], step=step).wait()
    return states


def ckpt_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def remove_shards(folder: Path) -> list[str]:
    """Half a ``rm -r``: the shards go, the manifest stays."""
    gone = sorted(p.name for p in folder.glob("shard-*"))
    for name in gone:
        (folder / name).unlink()
    return gone


# ---- progress -------------------------------------------------------------------------------------------------


def test_verify_progress_moves_in_bytes_on_one_large_checkpoint(tmp_path, capsys) -> None:
    save_core(tmp_path / "core", 1, big=True)
    torch.save({"global_step": 3, "state_dict": {"w": torch.randn(BIG)}}, tmp_path / "big.ckpt")
    for path in (ckpt_dir(tmp_path / "core", 1), tmp_path / "big.ckpt"):
        code, out, err = run(["verify", str(path), "--progress"], capsys)
        assert code == 0 and out == f"OK  {path}\n"
        assert moved(percents(err, "verifying")), err  # moves inside the one checkpoint, in bytes
        assert "MB / 40.0 MB" in err and "\x1b" not in err
    # Not a terminal and no flag (a pipe, a log, this capture): the output is the command's own, nothing more.
    code, out, err = run(["verify", str(tmp_path / "big.ckpt")], capsys)
    assert code == 0 and err == ""


def test_export_and_import_progress_reads_and_writes_in_bytes(tmp_path, capsys) -> None:
    states = save_core(tmp_path / "core", 7, big=True)
    src = ckpt_dir(tmp_path / "core", 7)
    code, _, err = run(["export", str(src), str(tmp_path / "out.pt"), "--to", "torch", "--progress"], capsys)
    assert code == 0 and moved(percents(err, "reading")), err
    assert percents(err, "writing")[-1] == 100
    assert_bit_equal(torch.load(tmp_path / "out.pt", weights_only=True), states[7])
    code, _, err = run(["import", str(tmp_path / "out.pt"), str(tmp_path / "core2"), "--step", "7", "--progress"],
                       capsys)
    assert code == 0 and moved(percents(err, "reading")), err
    assert percents(err, "writing")[-1] == 100 and "writing" in err
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "core2"))) as ckpt:
        assert_bit_equal(ckpt.load(step=7), states[7])
    code, _, err = run(["export", str(src), str(tmp_path / "quiet.pt"), "--to", "torch"], capsys)
    assert code == 0 and err == ""


def test_progress_moves_on_s3(s3_root, tmp_path, capsys) -> None:
    """An object store: ranged reads through ``CountingStorage`` (verify, export) and counted uploads (import)."""
    opts = ["--storage-options", json.dumps(s3_root.storage_options)]
    config = CheckpointConfig(root=s3_root.url, storage_options=s3_root.storage_options, staging={"mode": "eager"})
    state = {"model": {"w": torch.randn(BIG, generator=torch.Generator().manual_seed(0))}}
    with Checkpointer(config) as ckpt:
        ckpt.save(state, step=2).wait()
    path = f"{s3_root.url}/step-000000002"
    code, out, err = run(["verify", path, "--progress", *opts], capsys)
    assert code == 0 and out == f"OK  {path}\n" and moved(percents(err, "verifying")), err
    code, _, err = run(["export", path, str(tmp_path / "s3.pt"), "--to", "torch", "--progress", *opts], capsys)
    assert code == 0 and moved(percents(err, "reading")), err
    assert_bit_equal(torch.load(tmp_path / "s3.pt", weights_only=True), state)
    code, out, err = run(["import", str(tmp_path / "s3.pt"), f"{s3_root.url}/imported", "--step", "2", "--progress",
                          *opts], capsys)
    assert code == 0 and percents(err, "writing")[-1] == 100, err
    with Checkpointer(CheckpointConfig(root=f"{s3_root.url}/imported", storage_options=s3_root.storage_options)) as ck:
        assert_bit_equal(ck.load(step=2), state)


def test_progress_on_a_terminal_redraws_one_line_without_escapes() -> None:
    from fastckpt.cli.progress import ByteProgress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    with ByteProgress("verifying x\x1b[2J", 1000, True, term) as bar:
        for _ in range(10):
            bar.add(100)
    text = term.getvalue()
    assert "\x1b" not in text and "verifying x\\x1b[2J" in text  # the name's escape shown, never obeyed
    assert text.count("\r") >= 10 and text.endswith("\n") and text.count("\n") == 1  # one line, redrawn
    assert "1.0 KB / 1.0 KB (100%)" in text


def test_progress_on_a_real_terminal_by_default(tmp_path) -> None:
    """stderr a pseudo-terminal, no flag: the line is drawn and redrawn there; stdout (a pipe) gets only ``OK``."""
    import pty

    torch.save({"w": torch.randn(BIG)}, tmp_path / "a.ckpt")
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    try:
        proc = subprocess.run([sys.executable, "-m", "fastckpt", "verify", str(tmp_path / "a.ckpt")], env=env,
                              stdout=subprocess.PIPE, stderr=slave, timeout=120, check=False)
    finally:
        os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the terminal's other end is closed and everything was read
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    text = seen.decode()
    assert proc.returncode == 0 and proc.stdout == f"OK  {tmp_path / 'a.ckpt'}\n".encode()
    draws = [d for d in text.split("\r") if d.strip()]
    assert len(draws) >= 3 and "\x1b" not in text and draws[-1].startswith("verifying") and text.endswith("\n")
    assert moved([int(p) for p in re.findall(r"\((\d+)%\)", text)]), text


def test_progress_is_never_written_into_a_pipe(tmp_path) -> None:
    torch.save({"w": torch.randn(1000)}, tmp_path / "a.ckpt")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run([sys.executable, "-m", "fastckpt", "verify", str(tmp_path / "a.ckpt")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"OK  {tmp_path / 'a.ckpt'}\n" and proc.stderr == ""


# ---- inspect ---------------------------------------------------------------------------------------------------


def test_inspect_has_a_header_aligned_columns_human_sizes_and_one_dtype_spelling(tmp_path, capsys) -> None:
    folder = tmp_path / "checkpoint_0"  # an Accelerate folder: safetensors (F32, BF16) beside a torch file
    folder.mkdir()
    save_file({"0.weight": torch.randn(300, 10), "0.bias": torch.randn(10).bfloat16()}, folder / "model.safetensors")
    torch.save({"state": {0: {"exp_avg": torch.randn(300, 10)}}, "param_groups": [{"lr": 0.1}]},
               folder / "optimizer.bin")
    code, out, _ = run(["inspect", str(folder), "--json"], capsys)
    assert code == 0
    dtypes = {t["key"]: t["dtype"] for t in json.loads(out)["tensors"]}
    assert dtypes == {"model.0.weight": "float32", "model.0.bias": "bfloat16",
                      "optimizer.state.0.exp_avg": "float32"}  # never F32 here and float32 there
    code, out, _ = run(["inspect", str(folder)], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"{folder}  (accelerate, 3 tensors, 24.0 KB, 1 other value)"
    header = lines[1]
    assert header.split() == ["KEY", "DTYPE", "SHAPE", "SIZE"]
    rows = lines[2:5]
    for name in ("DTYPE", "SHAPE"):  # every cell of a column starts where its header does
        at = header.index(name)
        assert all(row[at - 2: at] == "  " and row[at] != " " for row in rows), (name, rows)
    assert all(len(row) == len(header) for row in rows)  # SIZE right-aligned under its header
    assert [row.split()[-2:] for row in rows] == [["12.0", "KB"], ["20", "B"], ["12.0", "KB"]]
    assert "300x10" in rows[0] and "bfloat16" in rows[1]
    assert lines[5] == "" and lines[6].split() == ["KEY", "TYPE", "VALUE"] and "param_groups.0.lr" in lines[7]


# ---- the step a checkpoint records ----------------------------------------------------------------------------


def test_import_takes_the_step_the_checkpoint_records(tmp_path, capsys) -> None:
    lightning = {"global_step": 1234, "epoch": 2, "state_dict": {"w": torch.randn(5)}}
    torch.save(lightning, tmp_path / "epoch=2-last.ckpt")
    code, out, err = run(["import", str(tmp_path / "epoch=2-last.ckpt"), str(tmp_path / "core")], capsys)
    assert code == 0, err
    assert out.endswith("(step 1234, as recorded in it)\n")
    states = save_core(tmp_path / "src", 40)  # a core checkpoint: its manifest's step
    code, _, err = run(["import", str(ckpt_dir(tmp_path / "src", 40)), str(tmp_path / "core")], capsys)
    assert code == 0, err
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "core"))) as ckpt:
        assert [i.step for i in ckpt.list()] == [40, 1234]
        assert_bit_equal(ckpt.load(step=1234), lightning)
        assert_bit_equal(ckpt.load(step=40), states[40])
    torch.save({"w": torch.randn(5)}, tmp_path / "plain.pt")  # records no step: refused, never guessed
    code, _, err = run(["import", str(tmp_path / "plain.pt"), str(tmp_path / "core")], capsys)
    assert code == 1 and "plain.pt records no training step" in err and "--step N" in err
    code, out, err = run(["import", str(tmp_path / "plain.pt"), str(tmp_path / "core"), "--step", "5"], capsys)
    assert code == 0 and out.endswith("(step 5)\n")


def test_accelerate_list_shows_the_training_step(tmp_path, capsys) -> None:
    """A stock folder's step is its optimizer's step count (``optimizer.bin``: the ``step`` AdamW keeps with each
    parameter), not the folder's index nor ``Accelerator.step`` (``random_states_0.pkl``'s ``step``: 0 without
    gradient accumulation, issue 55 item 7). An optimizer that keeps no count (SGD) leaves the step unknown. Rows
    stay in the order of the saves (the folder index)."""
    import numpy as np
    import random

    for index, step in ((0, 150), (1, 300), (2, None), (10, 20)):
        folder = tmp_path / "checkpoints" / f"checkpoint_{index}"
        folder.mkdir(parents=True)
        save_file({"w": torch.randn(3)}, folder / "model.safetensors")
        rng = {"step": 0, "random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
               "torch_manual_seed": torch.get_rng_state()}
        torch.save(rng, folder / "random_states_0.pkl")
        state = {} if step is None else {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(3)},
                                         1: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(1)}}
        torch.save({"state": state, "param_groups": [{"lr": 0.1, "params": [0, 1]}]}, folder / "optimizer.bin")
    code, out, _ = run(["list", str(tmp_path), "--json"], capsys)
    assert code == 0
    assert [(r["name"], r["step"]) for r in json.loads(out)] == [
        ("checkpoint_0", 150), ("checkpoint_1", 300), ("checkpoint_2", None), ("checkpoint_10", 20)]  # None: "-"
    code, out, _ = run(["list", str(tmp_path)], capsys)
    assert [line.split()[0] for line in out.splitlines()] == ["STEP", "150", "300", "-", "20"]
    code, out, _ = run(["import", str(tmp_path / "checkpoints" / "checkpoint_1"), str(tmp_path / "core")], capsys)
    assert code == 0 and "(step 300, as recorded in it)" in out
    code, out, _ = run(["inspect", str(tmp_path / "checkpoints" / "checkpoint_1")], capsys)
    assert code == 0 and "(accelerate, step 300, " in out.splitlines()[0]
    code, out, _ = run(["gc", str(tmp_path / "checkpoints"), "--keep-last", "1"], capsys)  # the newest save stays
    left = sorted(p.name for p in (tmp_path / "checkpoints").glob("checkpoint_*"))
    assert code == 0 and left == ["checkpoint_10", "checkpoint_2"]  # a folder recording no step is never removed


# ---- control characters ---------------------------------------------------------------------------------------


def test_no_escape_sequence_reaches_the_terminal(tmp_path, capsys) -> None:
    evil = "\x1b]8;;x\x07\x1b[2J"  # a forged link and a screen clear (no slash: one file name)
    dirpath = tmp_path / "ckpts"
    dirpath.mkdir()
    torch.save({"global_step": 1, "epoch": 0, f"key{evil}": torch.zeros(2)}, dirpath / f"epoch=0-step=1{evil}.ckpt")
    (dirpath / f"epoch=0-step=2{evil}.ckpt").write_bytes(b"PK\x03\x04" + b"\0" * 64)  # torn
    outputs = [run(["list", str(dirpath)], capsys), run(["inspect", str(dirpath / f"epoch=0-step=1{evil}.ckpt")],
                                                        capsys),
               run(["verify", str(dirpath / f"epoch=0-step=2{evil}.ckpt")], capsys),
               run(["inspect", str(tmp_path / f"missing{evil}")], capsys)]
    for code, out, err in outputs:
        assert "\x1b" not in out + err and "\x07" not in out + err
    assert "epoch=0-step=1\\x1b]8;;x\\x07\\x1b[2J.ckpt" in outputs[0][1]  # visible, so the user sees it
    assert "key\\x1b]8;;" in outputs[1][1]
    assert outputs[2][0] == 1 and outputs[3][0] == 1 and "missing\\x1b" in outputs[3][2]
    with pytest.raises(SystemExit):  # argparse quotes what was typed: escaped too
        main(["list", str(dirpath), evil])
    err = capsys.readouterr().err
    assert "unrecognized arguments: \\x1b]8;;x\\x07" in err and "\x1b" not in err


# ---- a checkpoint deleted part way ----------------------------------------------------------------------------


def test_list_shows_a_half_deleted_checkpoint_as_damaged(tmp_path, capsys) -> None:
    root = tmp_path / "core"
    save_core(root, 1, 2, 3)
    gone = remove_shards(ckpt_dir(root, 3))
    shard = next(ckpt_dir(root, 2).glob("shard-*"))
    shard.write_bytes(shard.read_bytes()[:-10])  # a copy that stopped short
    code, out, _ = run(["list", str(root), "--json"], capsys)
    assert code == 0
    rows = json.loads(out)
    assert [(r["step"], r["status"]) for r in rows] == [(1, "committed"), (2, "damaged"), (3, "damaged")]
    assert rows[0]["problem"] is None and gone[0] in rows[2]["problem"] and "missing" in rows[2]["problem"]
    assert shard.name in rows[1]["problem"] and "manifest says" in rows[1]["problem"]
    code, out, err = run(["list", str(root)], capsys)
    row = out.splitlines()[3].split()
    assert code == 0 and row[-1] == "step-000000003" and "damaged" in row, row
    assert "step-000000003 is damaged" in err and gone[0] in err


def test_list_shows_a_half_deleted_stock_accelerate_folder_as_damaged(tmp_path, capsys) -> None:
    for index in (0, 1):
        folder = tmp_path / "checkpoints" / f"checkpoint_{index}"
        folder.mkdir(parents=True)
        save_file({"w": torch.randn(3)}, folder / "model.safetensors")
        torch.save({"step": index + 1}, folder / "random_states_0.pkl")
        torch.save({"state": {}}, folder / "optimizer.bin")
    (tmp_path / "checkpoints" / "checkpoint_1" / "model.safetensors").unlink()
    code, out, _ = run(["list", str(tmp_path), "--json"], capsys)
    assert code == 0
    assert [(r["name"], r["status"]) for r in json.loads(out)] == [("checkpoint_0", "committed"),
                                                                   ("checkpoint_1", "damaged")]


def test_load_of_a_damaged_latest_names_the_older_step_that_loads(tmp_path) -> None:
    root = tmp_path / "core"
    states = save_core(root, 1, 2, 3)
    remove_shards(ckpt_dir(root, 3))
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
        with pytest.raises(IntegrityError) as e:
            ckpt.load()
        msg = str(e.value)
        assert "step-000000003" in msg and "missing" in msg
        assert "step-000000002 (step 2)" in msg and "load(step=2)" in msg
        assert_bit_equal(ckpt.load(step=2), states[2])  # what the message says loads, loads
        remove_shards(ckpt_dir(root, 2))
        with pytest.raises(IntegrityError, match=r"load\(step=1\)"):
            ckpt.load()
        with pytest.raises(IntegrityError, match=r"step-000000002.*load\(step=1\)"):
            ckpt.load(step=2)
        remove_shards(ckpt_dir(root, 1))
        with pytest.raises(IntegrityError, match="no older checkpoint under .* has all its files"):
            ckpt.load()
