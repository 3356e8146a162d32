"""The two small collectives a save or load needs, on the training process group, from the calling thread.

They carry a few kilobytes (RNG and dataloader states, a checkpoint path), and every process reaches them
from ``save_state``/``load_state``, which Accelerate already requires every process to call.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch.distributed as dist
from accelerate import Accelerator

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
