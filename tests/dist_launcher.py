"""Run a test function on N gloo ranks (separate processes), propagating any rank's failure."""
from __future__ import annotations

import os
import socket
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes; raises if any rank raised."""
    mp.start_processes(_entry, args=(world, _free_port(), fn, args), nprocs=world, join=True, start_method="spawn")
