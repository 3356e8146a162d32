"""The Lightning child of the preemption trials (tests/preempt_trials.py): a fit with the fastckpt plugin and
``preemption.enabled``, SIGTERM at a random step; the final checkpoint is ``preempted-step=N.ckpt``."""
from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import torch

from tests import preempt_trials
from tests.preempt_trials import CHILD_AS_BYTES, SAVE_EVERY, Trial


def lightning_child(root: str, grace_s: float, shm_dir: str | None, conn: Any) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS_BYTES, CHILD_AS_BYTES))
    # One intra-op thread: the model is tiny, and beside CPU-bound neighbours each op's parallel region waited for a
    # second OpenMP thread to be scheduled (batch_norm and backward took 50-90 ms a step instead of 1 ms).
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fastckpt_lightning import FastCheckpointIO

    path = Path(root)

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class Report(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            conn.send(("step", trainer.global_step))

        def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ckpt: dict) -> None:
            if plugin.callback.preemption.preemption is not None and plugin.callback.preemption.preemption.preempted:
                preempt_trials._record(path, {k: v.clone() for k, v in pl_module.state_dict().items()},
                                       trainer.global_step)
                conn.send(("recorded", trainer.global_step))

    plugin = FastCheckpointIO(config={"root": root, "persist": {"fsync": False},
                                      "preemption": {"enabled": True, "grace_s": grace_s}})
    gen = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(16 * 4000, 32, generator=gen))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4000, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[plugin], default_root_dir=root,
                         callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=SAVE_EVERY, save_top_k=-1),
                                    Report()])
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=16))


def judge_lightning(root: Path, seen: int, exitcode: int | None, recorded: int | None, killed: bool) -> Trial:
    from tests.helpers import assert_bit_equal

    steps = {}
    for f in root.glob("*.ckpt"):
        ckpt = torch.load(f, weights_only=False, map_location="cpu")
        steps[f.name] = (ckpt["global_step"], ckpt["state_dict"])
    latest = max((s for s, _ in steps.values()), default=None)
    exact = False
    final = f"preempted-step={recorded}.ckpt"
    if recorded is not None and latest == recorded and final in steps:
        want = torch.load(root.parent / "recorded.pt", weights_only=True)["state"]
        try:
            assert_bit_equal(steps[final][1], want)
            exact = True
        except AssertionError:
            pass
    return Trial(seen, exitcode, recorded, latest, exact, killed)


preempt_trials.CHILDREN["lightning"] = lightning_child
preempt_trials.JUDGES["lightning"] = judge_lightning
# s3fs: ModelCheckpoint's setup imports it (a second in every child) to ask whether its folder is object storage
preempt_trials.PRELOAD.extend(["lightning.pytorch", "fastckpt_lightning", "s3fs", "tests.preempt_frontends"])


def accelerate_child(root: str, grace_s: float, shm_dir: str | None, conn: Any) -> None:
    """Accelerate with automatic checkpoint naming, ``save_state()`` every SAVE_EVERY steps."""
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS_BYTES, CHILD_AS_BYTES))
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from fastckpt_accelerate import enable

    path = Path(root)
    model, opt = preempt_trials._model()
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=root, automatic_checkpoint_naming=True))
    step = 0

    def record(*_: Any) -> None:  # registered before enable()'s hook: runs first at the same step
        if checkpointing.preemption.preemption.preempted and not (path.parent / "recorded.pt").exists():
            preempt_trials._record(path, {k: v.clone() for k, v in model.state_dict().items()}, step)
            conn.send(("recorded", step))

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    hook = register_optimizer_step_pre_hook(record)
    checkpointing = enable(accelerator, {"persist": {"fsync": False},
                                         "preemption": {"enabled": True, "grace_s": grace_s}})
    model, opt = accelerator.prepare(model, opt)
    gen = torch.Generator().manual_seed(1)
    try:
        while True:
            loss = model(torch.randn(16, 32, generator=gen)).pow(2).mean()
            opt.zero_grad()
            accelerator.backward(loss)
            opt.step()
            step += 1
            if step % SAVE_EVERY == 0:
                accelerator.save_state()
            conn.send(("step", step))
    finally:
        hook.remove()


def judge_accelerate(root: Path, seen: int, exitcode: int | None, recorded: int | None, killed: bool) -> Trial:
    from safetensors.torch import load_file

    from tests.helpers import assert_bit_equal

    folders = sorted((root / "checkpoints").glob("checkpoint_*"), key=lambda p: int(p.name.split("_")[1]))
    folders = [f for f in folders if (f / "manifest.json").exists()]  # committed ones
    exact, latest = False, None
    if folders:
        newest = load_file(str(folders[-1] / "model.safetensors"))
        latest = len(folders)
        rec = root.parent / "recorded.pt"
        if recorded is not None and rec.exists():
            want = torch.load(rec, weights_only=True)["state"]
            try:
                assert_bit_equal(dict(sorted(newest.items())), dict(sorted(want.items())))
                exact = True
            except AssertionError:
                pass
    # latest: how many checkpoints committed; the final one is the (recorded // SAVE_EVERY + 1)-th
    if exact and recorded is not None and latest == recorded // SAVE_EVERY + 1:
        latest = recorded
    return Trial(seen, exitcode, recorded, latest, exact, killed)


preempt_trials.CHILDREN["accelerate"] = accelerate_child
preempt_trials.JUDGES["accelerate"] = judge_accelerate
preempt_trials.PRELOAD.extend(["accelerate", "fastckpt_accelerate"])
