"""``FastModelParallelStrategy`` on a model with empty local shards (FSDP2, 2 gloo ranks on CPU), beside stock.

``Linear(32, 1)``'s weight is one row: on 2 ranks, rank 1 holds a [0, 32] block, and its optimizer state is empty
too (and ``Linear(32, 3)`` splits 2 + 1). Stock ``ModelParallelStrategy`` saves such a model; the fast strategy must
too, train exactly as stock does, write folders holding the very values of each step, and resume from one on
another world size.

Lightning's launcher starts the other ranks by re-running the command line, so each phase runs this file as a
script (as ``test_lightning_sharded.py`` does).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow


def _run_phase(root: Path, phase: str, devices: int, max_steps: int, ckpt_path: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, __file__, str(root), phase, str(devices), str(max_steps), ckpt_path]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{phase} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def test_empty_local_shards_save_as_stock_and_resume_on_one_rank(tmp_path) -> None:
    from helpers import assert_bit_equal

    from fastckpt import consolidate

    # One launch of 2 ranks trains stock, then fast (a fresh Trainer, strategy and module each: see the script)
    _run_phase(tmp_path, "stock,fast", 2, 2, "none")
    names = {phase: sorted(p.name for p in (tmp_path / phase).iterdir() if not p.name.startswith("."))
             for phase in ("stock", "fast")}
    assert names["fast"] == names["stock"] == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"], names
    for step in (1, 2):
        fast = torch.load(tmp_path / f"fast-step{step}.pt", weights_only=True)
        assert_bit_equal(torch.load(tmp_path / f"stock-step{step}.pt", weights_only=True), fast)  # training unchanged
        saved = consolidate(str(tmp_path / "fast" / f"epoch=0-step={step}.ckpt"))
        assert saved["global_step"] == step
        assert_bit_equal(fast["model"], {k.removeprefix("net."): v for k, v in saved["state_dict"].items()})
        assert fast["model"]["head.weight"].shape == (1, 32)

    _run_phase(tmp_path, "resume", 1, 2, str(tmp_path / "fast" / "epoch=0-step=1.ckpt"))
    assert_bit_equal(torch.load(tmp_path / "fast-step1.pt", weights_only=True),
                     torch.load(tmp_path / "resume-start.pt", weights_only=True))


# ---- the script (every rank) -------------------------------------------------------------------------------------


def _main(root: Path, phase: str, devices: int, max_steps: int, ckpt_path: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.utils.data import DataLoader, TensorDataset

    from fastckpt_lightning import FastCheckpointIO, FastModelParallelStrategy

    class Body(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = nn.Linear(32, 3)  # 2 + 1 rows on 2 ranks
            self.out = nn.Linear(3, 1)  # one row: rank 1 holds none of it
            self.head = nn.Linear(32, 1)  # the model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.hidden(x).relu()) + self.head(x)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = Body()

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net.hidden, self.net.out, self.net.head):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Capture(Callback):
        """The full values after each step (those its checkpoint must hold), and on resume the loaded ones."""

        def _dump(self, trainer: pl.Trainer, module: Net, name: str) -> None:
            options = StateDictOptions(full_state_dict=True, cpu_offload=False)  # collective: every rank calls it
            state = {"model": get_model_state_dict(module.net, options=options),
                     "optim": get_optimizer_state_dict(module.net, trainer.optimizers[0], options=options)["state"],
                     "global_step": trainer.global_step}
            if trainer.is_global_zero:
                torch.save(state, root / f"{name}.pt")

        def on_train_start(self, trainer: pl.Trainer, module: Net) -> None:
            if phase == "resume":
                self._dump(trainer, module, "resume-start")

        def on_train_batch_end(self, trainer: pl.Trainer, module: Net, *args: Any) -> None:
            if phase != "resume":
                self._dump(trainer, module, f"{phase}-step{trainer.global_step}")

    if phase == "stock":
        strategy, plugins = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1), []
    else:
        strategy = FastModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
        plugins = [FastCheckpointIO(persist={"fsync": False})]
    checkpoints = ModelCheckpoint(dirpath=root / phase, every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, plugins=plugins,
                         callbacks=[checkpoints, Capture()], max_steps=max_steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    data = DataLoader(TensorDataset(torch.randn(16, 32, generator=torch.Generator().manual_seed(1))), batch_size=4)
    trainer.fit(Net(), data, ckpt_path=None if ckpt_path == "none" else ckpt_path)


if __name__ == "__main__":
    # Phases named "a,b" run one after the other in the same ranks (their imports cost more than their training):
    # each builds its own Trainer, strategy and module (seeded alike); Lightning reuses the initialized process
    # group and launches no ranks again (rank 0's launcher set LOCAL_RANK).
    for name in sys.argv[2].split(","):
        _main(Path(sys.argv[1]), name, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
