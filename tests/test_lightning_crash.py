"""SIGKILL during Lightning saves never leaves a torn file under a ``.ckpt`` name, and never harms the previous
checkpoint: the child (``lightning_crash_child.py``) saves ~100 MB at every step and is killed at random points of
its own report stream.

Each child is a fork of the forkserver the preemption trials use (tests/preempt_trials.py), which imports Lightning
and fastckpt once: a trial costs its training and saves, not an interpreter start and Lightning's import."""

from __future__ import annotations

import os
import random
import signal
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from fastckpt.format.torchfile import verify_torch_file
from lightning_crash_child import forked, state_crc
from tests import preempt_trials

TRIALS = 5  # each kill falls at a random point: an in-place writer failed every one of 8 trials (was 8 until issue 55)
SILENCE_S = 120.0  # a hang guard: a child reports every few milliseconds while it trains and saves

# At import (collection), so that the forkserver has them whichever test starts it first. By top-level name: the
# server's sys.path is a plain interpreter's (Python 3.11 drops the sys_path it is given), without tests/. s3fs:
# ModelCheckpoint's setup imports it (a second) to ask whether its folder is object storage.
preempt_trials.PRELOAD.extend(["lightning.pytorch", "fastckpt_lightning", "s3fs"])


def _run_and_kill(ctx: Any, dirpath: Path, kill_at_line: int) -> list[list[str]]:
    """Start the child, SIGKILL it right after it reports line ``kill_at_line``; return the lines read."""
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=forked, args=(str(dirpath), writer), daemon=True)
    child.start()
    writer.close()
    lines: list[list[str]] = []
    try:
        while len(lines) < kill_at_line:
            if not reader.poll(SILENCE_S):
                raise TimeoutError(f"the child said nothing for {SILENCE_S} s after {len(lines)} lines")
            try:
                lines.append(reader.recv_bytes().decode().split())
            except EOFError:
                break
        if len(lines) == kill_at_line:
            os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.join(60)
        reader.close()
    assert len(lines) == kill_at_line, f"the child exited (rc {child.exitcode}) after {len(lines)} lines"
    return lines


def _check_folder(dirpath: Path, lines: list[list[str]]) -> bool:
    """Every ``.ckpt`` is sound and holds its step's state; the newest durable checkpoint survived. Returns whether
    the child died inside a file's write."""
    crcs = {int(line[1]): int(line[2]) for line in lines if line[0] == "state"}
    # Each file lands on its own (last.ckpt after the step's epoch= file): track the two names apart.
    durable_last = [int(line[2]) for line in lines if line[0] == "durable" and line[1].endswith("/last.ckpt")]
    durable_top = [int(line[2]) for line in lines if line[0] == "durable" and not line[1].endswith("/last.ckpt")]

    names = [name for name in os.listdir(dirpath) if name.endswith(".ckpt")]
    steps = {}
    for name in names:
        path = dirpath / name
        assert verify_torch_file(str(path)) == [], name
        assert zipfile.ZipFile(path).testzip() is None, name
        checkpoint = torch.load(path, weights_only=True)
        steps[name] = checkpoint["global_step"]
        assert state_crc(checkpoint["state_dict"]) == crcs[steps[name]], f"{name} does not hold its step's state"
        if name.startswith("epoch="):
            assert name.endswith(f"step={steps[name]}.ckpt"), name
    # The previous checkpoint is intact: under each name, the newest file known durable, or a newer one.
    if durable_last:
        assert steps.get("last.ckpt", -1) >= max(durable_last), (steps, durable_last)
    if durable_top:
        assert any(name.startswith("epoch=") and step >= max(durable_top) for name, step in steps.items()), \
            (steps, durable_top)
    return lines[-1][0] == "write"


@pytest.mark.slow
def test_sigkill_during_lightning_saves_never_tears_a_ckpt(tmp_path):
    rng, ctx = random.Random(20261123), preempt_trials.context()
    inside_write = 0
    for trial in range(TRIALS):
        dirpath = tmp_path / f"trial{trial}"
        # A step reports a few lines, a file's write about a hundred: most kill points fall inside a write.
        lines = _run_and_kill(ctx, dirpath, kill_at_line=rng.randint(2, 600))
        if dirpath.exists():
            inside_write += _check_folder(dirpath, lines)
    assert inside_write >= TRIALS // 2, f"only {inside_write} of {TRIALS} kills fell inside a write: the test lost its point"
