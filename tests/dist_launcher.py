"""Run a test function on N gloo ranks (separate processes), propagating any rank's failure with every rank's output.

Two things a loaded machine (or another test run beside this one) broke:

- a free port picked by binding port 0 and closing it is free only until someone else binds it: between the pick
  and rank 0's TCPStore bind (the children's imports take seconds under load) another launch, or one of gloo's own
  ephemeral sockets, could take it, and a rank then fails or joins the wrong store. The ranks rendezvous through a
  ``FileStore`` in a private folder instead: no port to race for.
- ``torch.multiprocessing`` reports only the first failing rank's traceback, and kills the others, whose lines went
  to the shared stdout/stderr, mixed. Each rank writes its output to its own file, and a failure raises
  ``RanksFailed`` with every rank's file appended.
- a rank that hangs (a collective the other rank never joins) used to be cut by pytest-timeout in the parent, which
  showed only the parent's frame. The launcher has its own deadline, a little under pytest's: it asks every rank for
  a dump of all its threads (faulthandler on SIGUSR1, into the rank's log), then kills them and raises
  ``RanksFailed`` with those dumps.
- a rank that succeeded could still die at exit, of SIGABRT ("terminate called without an active exception"), while
  the interpreter finalized: reproduced with stock torch alone (2026-11-29: two gloo ranks that import
  ``torch.distributed.fsdp`` and build a device mesh, 50 async all_gathers each, 1 abort in about 30 launches beside
  two CPU-bound processes). With FSDP imported, ``destroy_process_group`` no longer frees the default gloo group: its
  worker threads outlive it, and one that drops a finished work a moment after ``wait()`` returned releases tensors'
  Python objects, which needs the GIL, which a finalizing interpreter never gives back (the thread is unwound through
  a ``noexcept`` frame: ``std::terminate``). A rank whose function returned therefore ends the way the interpreter
  would, minus the finalization: its non-daemon threads joined, its exit hooks run, then ``os._exit(0)``.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import threaddump

_TAIL = 8000  # characters of each rank's log in a failure message
# Under pytest-timeout (300 s in pyproject.toml), so that the launcher, not pytest, reports a hang with the ranks'
# stacks. FASTCKPT_RANKS_DEADLINE_S overrides it (a debugging session that wants to attach py-spy first).
DEADLINE_S = float(os.environ.get("FASTCKPT_RANKS_DEADLINE_S", "270"))


def same_replicas(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> None:
    """Rank 0's parameters, buffers and optimizer state on every rank (a collective), as DDP keeps its replicas.

    Ranks that compute the same training steps each on its own need not agree to the last bit: a fresh-clone CI run
    (2026-11-28) had a 2-rank and a 4-rank test's replicas differ after two or three AdamW steps, on a quiet machine,
    where they had agreed in 16 loaded passes. A CPU kernel's rounding can depend on where its memory lies, and AdamW
    turns a last-bit difference in a near-zero gradient (a bias before BatchNorm has one) into a whole step of
    ``lr``. A test whose premise is identical replicas makes them so, as DDP's all-reduce does."""
    tensors = list(model.state_dict().values())  # parameters and buffers, sharing the module's storage
    if opt is not None:
        tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t, src=0)


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
    threaddump.arm(sys.stderr)  # the launcher's hang dump, into this rank's log
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{folder}/store")
    try:
        fn(rank, world, *args)
        dist.barrier()
    except BaseException:
        traceback.print_exc()  # into this rank's log: the launcher's message keeps only the first failure
        raise
    finally:
        dist.destroy_process_group()
    _exit_without_finalizing()


def _exit_without_finalizing() -> None:
    """What ``sys.exit(0)`` does for a rank, except the interpreter's finalization (see the module's docstring)."""
    for t in threading.enumerate():  # as the interpreter's exit would: a thread left running still hangs the rank
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()  # fastckpt's exit flush, multiprocessing's own clean-up: still run, interpreter alive
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_report(folder: Path) -> str:
    """Every rank's log (its tail), one section each."""
    return "".join(f"\n----- {p.stem} -----\n{p.read_text(errors='replace')[-_TAIL:]}"
                   for p in sorted(folder.glob("rank*.log")))


def _dump_and_kill(processes: list, folder: Path) -> str:
    """Every live rank's threads (faulthandler, into its log), then SIGKILL; returns the logs."""
    live = [p for p in processes if p.is_alive()]
    threaddump.request(p.pid for p in live)
    for p in live:
        p.kill()
        p.join(10)
    return rank_report(folder)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes; raises ``RanksFailed`` (every rank's output) if any rank
    raised or died. On success each rank's output is echoed, so pytest's capture shows it as before."""
    folder = Path(tempfile.mkdtemp(prefix="fastckpt-ranks-"))
    try:
        context = mp.start_processes(_entry, args=(world, str(folder), fn, args), nprocs=world, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + DEADLINE_S
        try:
            while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise RanksFailed(f"ranks still running after {DEADLINE_S:.0f} s (a hang?); every rank's "
                                      f"threads and output:{_dump_and_kill(context.processes, folder)}")
        except RanksFailed:
            raise
        except Exception as e:
            raise RanksFailed(f"{e}\nevery rank's output:{rank_report(folder)}") from e
        print(rank_report(folder))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
