"""The two small collectives a save or load needs, on the training process group, from the calling thread,
and the test of whether the processes may share the writes of one checkpoint.

The collectives carry a few kilobytes (RNG and dataloader states, a checkpoint path), and every process
reaches them from ``save_state``/``load_state``, which Accelerate already requires every process to call.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch.distributed as dist
from accelerate import Accelerator

from .naming import is_url

T = TypeVar("T")


def is_distributed(accelerator: Accelerator) -> bool:
    """Whether collectives are needed (and possible) for this accelerator."""
    return accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized()


def all_gather(accelerator: Accelerator, obj: T) -> list[T]:
    """``obj`` from every process, indexed by process; every process gets the full list."""
    if not is_distributed(accelerator):
        return [obj]
    gathered: list[Any] = [None] * accelerator.num_processes
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_from_main(accelerator: Accelerator, obj: T) -> T:
    """The main process's ``obj`` on every process."""
    if not is_distributed(accelerator):
        return obj
    box: list[Any] = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def can_share_writes(accelerator: Accelerator, root: str) -> bool:
    """Whether every process can write its part of a checkpoint under ``root`` for rank 0 to commit.

    True for an object store (``s3://``...) and for a local path when every process runs on this node
    (torchrun's ``LOCAL_WORLD_SIZE`` equals the world size). Not for node-local disks of several nodes
    (rank 0 would commit files it cannot see), nor for ``memory://``, which is private to each process.
    """
    if not is_distributed(accelerator):
        return False
    if is_url(root):
        return not root.startswith("memory://")
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    return local_world is not None and int(local_world) == accelerator.num_processes
