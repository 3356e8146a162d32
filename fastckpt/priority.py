"""CPU priority of the background threads that persist checkpoints.

Checksums, writes, uploads and commits have seconds of slack: nobody waits for them
until the next ``save`` needs a slot. The training thread has none. So these threads
ask the kernel to run them only on CPU time that training leaves over:

- ``idle`` (default): ``SCHED_IDLE``. The thread runs when a core would otherwise be
  idle, and a waking training thread preempts it at once. On a host whose cores all
  stay busy the writes slow down rather than the training.
- ``low``: nice 19, the weakest normal share (about 1.5% of a core against a
  nice-0 thread).
- ``normal``: the process's own priority.

The copy thread is not lowered: the next ``optimizer.step()`` waits for it, so
starving it would turn overlap into a stall.

Where the platform has no ``SCHED_IDLE``, ``idle`` falls back to ``low``. Where the OS
refuses (a seccomp profile, no per-thread priorities), the thread keeps its priority and
a debug line says so: priority is an optimisation, never a reason to fail a checkpoint.
"""
from __future__ import annotations

import logging
import os
import threading

__all__ = ["PRIORITIES", "lower_this_thread"]

log = logging.getLogger("fastckpt")

PRIORITIES = ("idle", "low", "normal")
_LOW_NICE = 19


def lower_this_thread(priority: str) -> None:
    """Called by a background thread on itself: apply ``priority`` (one of ``PRIORITIES``)."""
    if priority == "normal":
        return
    try:
        if priority == "idle" and hasattr(os, "SCHED_IDLE"):
            # pid 0 is the calling thread (Linux schedules threads, not processes).
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _LOW_NICE)
    except (AttributeError, OSError) as e:
        log.debug("fastckpt: could not lower the priority of %s to %s: %s",
                  threading.current_thread().name, priority, e)
