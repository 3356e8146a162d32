"""Run a test function on N gloo ranks (separate processes), propagating any rank's failure with every rank's output.

Two things a loaded machine (or another test run beside this one) broke:

- a free port picked by binding port 0 and closing it is free only until someone else binds it: between the pick
  and rank 0's TCPStore bind (the children's imports take seconds under load) another launch, or one of gloo's own
  ephemeral sockets, could take it, and a rank then fails or joins the wrong store. The ranks rendezvous through a
  ``FileStore`` in a private folder instead: no port to race for.
- ``torch.multiprocessing`` reports only the first failing rank's traceback, and kills the others, whose lines went
  to the shared stdout/stderr, mixed. Each rank writes its output to its own file, and a failure raises
  ``RanksFailed`` with every rank's file appended.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

_TAIL = 8000  # characters of each rank's log in a failure message


class RanksFailed(RuntimeError):
    """A rank raised or died; the message carries every rank's output."""


def _entry(rank: int, world: int, folder: str, fn: Callable[..., Any], args: tuple) -> None:
    fd = os.open(os.path.join(folder, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # A file is block-buffered: a rank killed by the launcher after another failed would lose its last lines.
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{folder}/store")
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        traceback.print_exc()  # into this rank's log: the launcher's message keeps only the first failure
        raise
    finally:
        dist.destroy_process_group()


def rank_report(folder: Path) -> str:
    """Every rank's log (its tail), one section each."""
    return "".join(f"\n----- {p.stem} -----\n{p.read_text(errors='replace')[-_TAIL:]}"
                   for p in sorted(folder.glob("rank*.log")))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes; raises ``RanksFailed`` (every rank's output) if any rank
    raised or died. On success each rank's output is echoed, so pytest's capture shows it as before."""
    folder = Path(tempfile.mkdtemp(prefix="fastckpt-ranks-"))
    try:
        try:
            mp.start_processes(_entry, args=(world, str(folder), fn, args), nprocs=world, join=True,
                               start_method="spawn")
        except Exception as e:
            raise RanksFailed(f"{e}\nevery rank's output:{rank_report(folder)}") from e
        print(rank_report(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
