"""Lightning integration of fastckpt: ``Trainer(plugins=[FastCheckpointIO("fastckpt.yaml")])``."""

from fastckpt_lightning.callback import FastCheckpointCallback
from fastckpt_lightning.checkpoint_io import FastCheckpointIO
from fastckpt_lightning.ddp import FastDDPStrategy
from fastckpt_lightning.healthy import find_healthy_checkpoint
from fastckpt_lightning.model_checkpoint import FastModelCheckpoint, find_last_checkpoint
from fastckpt_lightning.sharded import FastFSDPStrategy, FastModelParallelStrategy
from fastckpt_lightning.stats import CheckpointStats

__all__ = [
    "CheckpointStats",
    "FastCheckpointCallback",
    "FastCheckpointIO",
    "FastDDPStrategy",
    "FastFSDPStrategy",
    "FastModelCheckpoint",
    "FastModelParallelStrategy",
    "find_healthy_checkpoint",
    "find_last_checkpoint",
]
