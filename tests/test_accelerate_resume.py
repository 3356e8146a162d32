"""Bit-exact resume in fresh processes, through examples/accelerate_train.py, on 1 and 2 processes.

Each scenario trains N steps with ``save_state`` every step, once without interruption and once stopped
after step K (leaving without ``end_training``: the exit hook must commit the pending checkpoint) and
resumed in a new process. Weights, optimizer, scheduler, RNG, loss history and ``iteration`` must match.
On two processes both runs write from the main process (the native format: stock Accelerate's files, every
rank's ``random_states_{rank}.pkl`` among them), and every rank must resume exactly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accelerate_testing import assert_same
from fastckpt.storage.local import LocalStorage
from fastckpt.read.verify import verify_checkpoint
from tests.helpers import listed as _listed

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "accelerate_train.py"
STEPS, STOP_AFTER = 8, 5


def run_example(args: list[str], num_processes: int, cwd: Path) -> str:
    if num_processes == 1:
        command = [sys.executable, str(EXAMPLE)]
    else:
        # `accelerate launch --cpu --num_processes 2` starts ONE process in Accelerate 1.15 (its CPU
        # multi-process path needs mpirun), so launch the same way it does on GPUs: torchrun, with
        # ACCELERATE_USE_CPU making the Accelerator pick MULTI_CPU over gloo.
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(num_processes), str(EXAMPLE)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"  # two processes on a small machine
    env["ACCELERATE_USE_CPU"] = "1"
    result = subprocess.run(command + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{command + args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def scenario(tmp_path: Path, num_processes: int) -> None:
    common = ["--steps", str(STEPS), "--save-every", "1", "--total-limit", "3"]
    # The uninterrupted run saves from the main process alone (as Accelerate does); the interrupted and
    # resumed runs let the processes share the writes (the default on one node). Both must end alike.
    straight = ["--project-dir", "straight", *common, "--dump", "straight", "--shared-writes", "off"]
    output = run_example(straight, num_processes, tmp_path)
    written = {int(r): int(n) for r, n in re.findall(r"process (\d+) of \d+ wrote (\d+) bytes", output)}
    assert written[0] > 0 and all(n == 0 for r, n in written.items() if r > 0), output  # the main process writes
    run_example(["--project-dir", "resumed", *common, "--stop-after", str(STOP_AFTER)], num_processes, tmp_path)
    checkpoints = tmp_path / "resumed" / "checkpoints"
    # The last save was pending when the script returned: the exit hook committed it.
    assert _listed(checkpoints) == [f"checkpoint_{i}" for i in range(STOP_AFTER - 3, STOP_AFTER)]
    resume_args = ["--project-dir", "resumed", *common, "--resume", "--dump", "resumed"]
    output = run_example(resume_args, num_processes, tmp_path)
    assert f"resumed from {checkpoints / f'checkpoint_{STOP_AFTER - 1}'}" in output
    assert _listed(checkpoints) == [f"checkpoint_{i}" for i in range(STEPS - 3, STEPS)]
    written = {int(r): int(n) for r, n in re.findall(r"process (\d+) of \d+ wrote (\d+) bytes", output)}
    assert sorted(written) == list(range(num_processes)), output  # every process ran and reported
    assert written[0] > 0 and all(n == 0 for r, n in written.items() if r > 0), output  # the main process writes

    last = checkpoints / f"checkpoint_{STEPS - 1}"
    names = set(os.listdir(last))  # stock's files, every rank's RNG among them, and the manifest
    assert {f"random_states_{r}.pkl" for r in range(num_processes)} | {"model.safetensors", "manifest.json"} <= names
    manifest = json.loads((last / "manifest.json").read_text())
    assert manifest["user"]["fastckpt_accelerate"]["num_processes"] == num_processes
    assert verify_checkpoint(LocalStorage(str(last)), str(last))[1] == []
    for rank in range(num_processes):
        straight = torch.load(tmp_path / f"straight.rank{rank}.pt", weights_only=False)
        resumed = torch.load(tmp_path / f"resumed.rank{rank}.pt", weights_only=False)
        assert straight["iteration"] == STEPS
        assert len(straight["progress"]["losses"]) == STEPS
        assert_same(straight, resumed, f"rank{rank}")
    if num_processes > 1:
        rank0 = torch.load(tmp_path / "straight.rank0.pt", weights_only=False)
        rank1 = torch.load(tmp_path / "straight.rank1.pt", weights_only=False)
        # The processes' RNG streams differ, so restoring rank 0's state everywhere would have failed.
        assert not torch.equal(rank0["torch_rng"], rank1["torch_rng"])
        # Parameters are replicated (written once, by rank 0). BatchNorm statistics are not: each rank
        # updates them in its own forward, and DDP re-broadcasts rank 0's at the next one.
        params = {k: v for k, v in rank0["model"].items() if "running" not in k and "num_batches" not in k}
        assert_same(params, {k: rank1["model"][k] for k in params})


def test_resume_in_a_new_process_is_bit_exact(tmp_path):
    scenario(tmp_path, num_processes=1)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_process_launch_shares_the_writes_and_resumes_every_rank_exactly(tmp_path):
    scenario(tmp_path, num_processes=2)
