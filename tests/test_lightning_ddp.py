"""Two CPU processes with strategy="ddp": rank 0 saves, every rank resumes from "last".

Lightning's DDP launcher starts the second rank by re-running the command line, so the test runs this file as a
script (see ``_run_phase``) instead of calling ``trainer.fit`` inside pytest.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
STOP_AT, TOTAL_STEPS = 3, 6


def _run_phase(phase: str, root: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    from rank_logs import run_phase

    code, _, report = run_phase([sys.executable, __file__, phase, str(root)], env, root / f"{phase}-logs", 240)
    assert code == 0, f"{phase} failed:\n{report}"


@pytest.mark.slow
def test_ddp_two_processes_save_on_rank_zero_and_resume_everywhere(tmp_path):
    from helpers import assert_bit_equal
    from lightning_support import ResumableBatches, TinyModule, make_trainer, training_state

    _run_phase("train", tmp_path)
    _run_phase("resume", tmp_path)

    ranks = [torch.load(tmp_path / f"resume-rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    assert [r["start_step"] for r in ranks] == [STOP_AT, STOP_AT], "a rank did not restore the checkpoint"
    assert_bit_equal(ranks[0]["state"], ranks[1]["state"])
    # Both ranks see the same batches, so DDP's averaged gradient equals the single-process one.
    module = TinyModule()
    make_trainer([], None, max_steps=TOTAL_STEPS, enable_checkpointing=False).fit(module, ResumableBatches())
    assert_bit_equal(ranks[0]["state"]["state_dict"], training_state(module)["state_dict"])
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == TOTAL_STEPS


def _worker(phase: str, root: Path) -> None:
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from fastckpt_lightning import FastCheckpointIO
    from lightning_support import ResumableBatches, TinyModule, make_trainer, training_state

    class StartStep(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.step = trainer.global_step

    start = StartStep()
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=1, save_last=True)
    plugin = FastCheckpointIO(persist={"fsync": False})
    trainer = make_trainer([checkpoints, start], plugin, devices=2, strategy="ddp",
                           max_steps=STOP_AT if phase == "train" else TOTAL_STEPS)
    module = TinyModule()
    trainer.fit(module, ResumableBatches(), ckpt_path="last" if phase == "resume" else None)
    result = {"start_step": start.step, "state": training_state(module)}
    torch.save(result, root / f"{phase}-rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    from rank_logs import split_rank_output

    split_rank_output()
    _worker(sys.argv[1], Path(sys.argv[2]))
