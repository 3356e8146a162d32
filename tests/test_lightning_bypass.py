"""Stock sharded strategies write their checkpoints without the plugin: FastCheckpointIO says so once, by name,
pointing at fastckpt's own strategy (issue 54, item 10).

``ModelParallelStrategy`` (FSDP2) trains on one CPU process with gloo, so its run is real; it initializes a process
group, so it runs in a process of its own. ``FSDPStrategy`` needs a GPU to train: its strategies are checked as
objects, with the same function the plugin calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastckpt_lightning.bypass import bypass_reason

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).resolve().parent

_CHILD = r"""
import json, os, sys, warnings
import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from lightning_models import ResumableBatches, TinyModule
from fastckpt_lightning import FastCheckpointIO, FastModelParallelStrategy

class Sharded(TinyModule):
    def configure_model(self):
        if not getattr(self, "sharded", False):  # a second fit calls it again: shard once
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
            self.sharded = True

kind, root = sys.argv[1], sys.argv[2]
make = FastModelParallelStrategy if kind == "fast" else ModelParallelStrategy
plugin = FastCheckpointIO()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=make(data_parallel_size=1, tensor_parallel_size=1),
                         max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[plugin], default_root_dir=root)
    module = Sharded()
    trainer.fit(module, train_dataloaders=ResumableBatches())
    trainer.fit(module, train_dataloaders=ResumableBatches())  # a second fit (setup again): said once
print(json.dumps([str(w.message) for w in caught if "FastCheckpointIO" in str(w.message)]))
"""


def _run(kind: str, root: Path) -> list[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _CHILD, kind, str(root)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_stock_model_parallel_with_the_plugin_warns_once_by_name(tmp_path):
    """Stock ModelParallelStrategy + FastCheckpointIO: its checkpoint is a DCP folder without fastckpt's manifest,
    and one warning names the strategy and FastModelParallelStrategy. Before: nothing was said."""
    warned = _run("stock", tmp_path)
    assert len(warned) == 1, warned
    assert "ModelParallelStrategy" in warned[0] and "FastModelParallelStrategy" in warned[0]
    folder = tmp_path / "checkpoints" / "epoch=0-step=2.ckpt"
    assert folder.is_dir() and not (folder / "manifest.json").exists()  # what the warning says: fastckpt not used


def test_fast_model_parallel_says_nothing(tmp_path):
    assert _run("fast", tmp_path) == []
    assert (tmp_path / "checkpoints" / "epoch=0-step=2.ckpt" / "manifest.json").is_file()


def test_each_strategy_is_judged_by_what_it_saves():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from fastckpt_lightning import FastDDPStrategy, FastFSDPStrategy, FastModelParallelStrategy

    sharded_fsdp = bypass_reason(FSDPStrategy(state_dict_type="sharded"))
    assert sharded_fsdp is not None and "FSDPStrategy(state_dict_type='sharded')" in sharded_fsdp
    assert "FastFSDPStrategy" in sharded_fsdp
    assert "FastModelParallelStrategy" in bypass_reason(ModelParallelStrategy())
    for through_the_plugin in (FSDPStrategy(state_dict_type="full"), FastFSDPStrategy(state_dict_type="sharded"),
                               ModelParallelStrategy(save_distributed_checkpoint=False), FastModelParallelStrategy(),
                               DDPStrategy(), FastDDPStrategy()):
        assert bypass_reason(through_the_plugin) is None, through_the_plugin
