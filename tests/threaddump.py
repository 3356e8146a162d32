"""Where a silent child process waits: every thread's stack, written by faulthandler on SIGUSR1.

The rank launcher (tests/dist_launcher.py) and the shared-memory crash trials' children (tests/shm_children.py) arm
their children with ``arm``; when a child outlives its deadline the parent calls ``request``, and the failure then
names where each of the child's threads waits instead of showing only the parent's frame.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import time
from typing import IO, Iterable

__all__ = ["arm", "request"]


def arm(file: IO[str]) -> None:
    """In the child: SIGUSR1 writes every thread's stack to ``file``, and so does a fatal signal (a C++ abort in gloo
    said only "terminate called without an active exception": this says where the Python threads were)."""
    faulthandler.register(signal.SIGUSR1, file=file, all_threads=True)
    faulthandler.enable(file=file, all_threads=True)
    # torch's spawn SIGTERMs the other ranks when one dies: where they were is the other half of the story
    faulthandler.register(signal.SIGTERM, file=file, all_threads=True, chain=True)


def request(pids: Iterable[int]) -> None:
    """In the parent: ask each armed child for its stacks, and give them the time to write them."""
    pids = list(pids)
    for pid in pids:
        os.kill(pid, signal.SIGUSR1)
    if pids:
        # faulthandler writes from a C signal handler and signals nothing back: no event to wait on; 2 s is plenty for
        # a few KB. Failure path only.
        time.sleep(2.0)
