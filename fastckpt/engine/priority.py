"""CPU priority of the background threads that persist checkpoints.

Checksums, writes, uploads and commits have seconds of slack: nobody waits for them
until the next ``save`` needs a slot. The training thread has none. So these threads
may ask the kernel to run them only on CPU time that training leaves over:

- ``normal`` (default): the process's own priority: nothing is changed.
- ``low``: nice 19, the weakest normal share (about 1.5% of a core against a
  nice-0 thread).
- ``idle``: ``SCHED_IDLE``. The thread runs when a core would otherwise be
  idle, and a waking training thread preempts it at once.

Why lowering is not the default: a lowered thread still holds the GIL while it runs
Python between its native calls (checksums, writes, torch ops release it). Where other
processes keep every core busy, a lowered thread preempted while it holds the GIL waits
seconds for its next slice, and the training thread, asking for the GIL, waits with it:
beside three CPU-bound processes on two cores, single training steps of 8 ms took 3 to
11 s (``idle``) and 4 s (``low``), and none over 56 ms at ``normal``
(``python -m benchmarks.run --only busy``). On a quiet host ``normal`` measured no worse
than ``idle`` (the plain loop's stall, 1.48 GB every 5 steps). Lower them only where
training is the only thing that runs.

On a host whose cores all stay busy (DataLoader workers decoding data) a lowered thread
gets almost nothing: a 6 MB checkpoint took seconds, and ``save`` then blocked on full
slots. So ``ThreadPriorities`` raises every enlisted thread to the training thread's own
policy while saves are pending (a save finds the previous checkpoint not yet durable), and
lowers them again once a save finds nothing pending. Only when persistence really falls
behind (a save waits for a staging slot, or a checkpoint stays not durable past
``persist.max_lag_s``) does one warning per process, on rank 0, name the measured lag.

Leaving ``SCHED_IDLE`` or lowering nice needs ``CAP_SYS_NICE`` or a large enough
``RLIMIT_NICE`` (most containers have neither). Where the kernel refuses, the lowered
threads stay lowered, so ``boost`` tells the pipeline to hand new writes to threads that
were never lowered until persistence catches up; the warning, if persistence falls behind,
names the fix.

The copy thread is never lowered: the next ``optimizer.step()`` waits for it. Where the OS
has no per-thread priorities, nothing changes: priority is an optimisation, never a reason
to fail a checkpoint.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable

from .once import WARNED

__all__ = ["Policy", "ThreadPriorities", "apply_policy", "policy_of"]

log = logging.getLogger("fastckpt")

_LOW_NICE = 19


@dataclass(frozen=True, slots=True)
class Policy:
    """A thread's scheduling class (``os.SCHED_*``), its static priority (0 but for real-time) and nice."""

    sched: int
    rt_priority: int
    nice: int


def policy_of(tid: int) -> Policy:
    """The policy of the thread with native id ``tid``."""
    return Policy(os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority,
                  os.getpriority(os.PRIO_PROCESS, tid))


def apply_policy(tid: int, policy: Policy) -> None:
    """Give thread ``tid`` ``policy``; raises ``OSError`` (``PermissionError`` when not allowed)."""
    if os.sched_getscheduler(tid) != policy.sched:
        os.sched_setscheduler(tid, policy.sched, os.sched_param(policy.rt_priority))
    # Linux keeps a nice value per thread, also under SCHED_IDLE; lowering it needs privilege,
    # so it is only written when it differs.
    if os.getpriority(os.PRIO_PROCESS, tid) != policy.nice:
        os.setpriority(os.PRIO_PROCESS, tid, policy.nice)


def _lowered(priority: str, normal: Policy) -> Policy | None:
    """The policy ``priority`` asks for, or None when it keeps the training thread's."""
    if priority == "normal":
        return None
    if priority == "idle" and hasattr(os, "SCHED_IDLE"):
        return Policy(os.SCHED_IDLE, 0, normal.nice)
    return Policy(os.SCHED_OTHER, 0, max(normal.nice, _LOW_NICE))  # no SCHED_IDLE: idle falls back to low


class ThreadPriorities:
    """The priority of one ``Checkpointer``'s background threads: lowered while persistence keeps up,
    raised to the training thread's own while it falls behind.

    Built on the training thread, whose policy is the "normal" one. Background threads call
    ``enlist`` on themselves when they start; the ``Checkpointer`` calls ``raise_`` and
    ``settle`` from ``save``/``wait``/``close``, so a starved thread never holds the lock
    that the training thread takes (only ``enlist`` runs elsewhere, and it makes no system
    call under the lock).
    """

    def __init__(self, priority: str, *, apply: Callable[[int, Policy], None] = apply_policy,
                 read: Callable[[int], Policy] = policy_of) -> None:
        self._apply = apply
        self._lock = threading.Lock()
        self._threads: dict[int, threading.Thread] = {}  # native id -> thread
        self._raised = False
        self._version = 0  # bumped by every raise/settle, so a stale enlist reapplies
        self._refused = False  # the kernel said no once: it will again, so stop asking
        self._boost = False  # raised, but refused: new work goes to threads that were never lowered
        self.raises = 0  # how many times the threads were raised
        try:
            self._normal: Policy | None = read(threading.get_native_id())
        except (AttributeError, OSError) as e:  # no per-thread priorities here
            log.debug("fastckpt: cannot read thread priorities (%s); persist.priority is ignored", e)
            self._normal = None
        self._low = _lowered(priority, self._normal) if self._normal is not None else None
        # Told True when the threads are raised and False when they settle, outside the lock: threads of another
        # process follow this level (the persister process, fastckpt/tiers/persister.py).
        self.on_change: Callable[[bool], None] | None = None

    @property
    def raised(self) -> bool:
        """Whether the background threads currently run at the training thread's priority."""
        return self._raised

    @property
    def boost(self) -> bool:
        """Read by the pipeline for each write: persistence is behind and its threads could not be raised, so
        the write goes to a thread that was never lowered."""
        return self._boost

    def enlist(self) -> None:
        """Called by a background thread on itself when it starts: apply the current level and
        remember the thread so that ``raise_``/``settle`` reach it."""
        if self._low is None:
            return
        me, tid = threading.current_thread(), threading.get_native_id()
        seen = -1
        while True:
            with self._lock:
                self._threads[tid] = me
                if seen == self._version:
                    return
                seen, raised = self._version, self._raised
            # Outside the lock: this thread may already be starved (a pool thread inherits the
            # lowered policy of the thread that spawned it), and save() must never wait for it.
            try:
                self._set(tid, self._normal if raised else self._low)  # type: ignore[arg-type]
            except PermissionError as e:  # raised while this thread inherited a lowered policy
                log.debug("fastckpt: could not raise new thread %d: %s", tid, e)

    def raise_(self, reason: str, *, behind: bool) -> None:
        """Called by the ``Checkpointer`` while saves are pending: run every enlisted thread at the training
        thread's priority. ``behind``: persistence really fell behind (a save waits for a slot, or a checkpoint
        stayed not durable past ``persist.max_lag_s``), and ``reason`` names the measured lag; only then is a
        warning due (once per process, on rank 0). A save that merely finds the previous one pending (``save_last``
        right after another save) or a ``wait()`` raises the threads quietly."""
        changed = False
        with self._lock:
            if self._low is not None and not self._raised and not self._boost:
                if self._refused:
                    self._boost = True
                else:
                    refused = self._apply_all(self._normal)  # type: ignore[arg-type]
                    self._refused = self._boost = refused is not None
                    if not self._refused:
                        self._raised = True
                        self._version += 1
                        self.raises += 1
                        changed = True
            refused_now = self._refused
        if changed and self.on_change is not None:
            self.on_change(True)
        if behind:
            self._warn(reason, refused_now)

    def waiting(self, why: str) -> None:
        """Called by a thread about to block on the background threads' work (``SaveHandle.wait``, the collective
        the committer runs for a ``save()`` that brings a new plan, a load draining the commits): raise them for
        it, quietly. Without this the waiter, at normal priority, waited on ``idle`` threads that a host whose
        cores stay busy never runs: a priority inversion (a 70 KB distributed save took minutes beside two
        CPU-bound processes). A lowered thread waiting on another does not raise: it must never hold the lock
        the training thread takes."""
        if threading.get_native_id() not in self._threads:
            self.raise_(why, behind=False)

    def _warn(self, reason: str, refused: bool) -> None:
        """The one warning of a process that persistence fell behind, with the fix that applies here."""
        if not WARNED.first("behind"):
            return
        if refused:
            log.warning("fastckpt: checkpoint persistence is falling behind (%s), and fastckpt could not raise the "
                        "checkpoint I/O threads back from persist.priority=%s. New writes go to threads at the training "
                        "thread's priority until persistence catches up, but work already started stays lowered. "
                        "Leaving SCHED_IDLE or lowering nice needs CAP_SYS_NICE (docker run --cap-add SYS_NICE) or "
                        "RLIMIT_NICE >= 20 (ulimit -e 20); on a host whose CPUs stay busy, set persist.priority: "
                        "normal. Warned once.", reason, self._name())
        elif self._low is not None:
            log.warning("fastckpt: checkpoint persistence is falling behind (%s). On a host whose CPUs are busy "
                        "(DataLoader workers) persist.priority=%s threads get almost no CPU, so they now run at the "
                        "training thread's priority until they catch up. If storage is the bottleneck instead, "
                        "checkpoint less often or raise persist.workers. Warned once.", reason, self._name())
        else:
            log.warning("fastckpt: checkpoint persistence is falling behind (%s): storage takes longer than the "
                        "checkpoint interval. Checkpoint less often, raise persist.workers, or use faster storage. "
                        "Warned once.", reason)

    def settle(self) -> None:
        """Called by the ``Checkpointer`` when nothing is pending: lower the threads again."""
        with self._lock:
            self._boost = False
            if not self._raised:
                return
            self._raised = False
            self._version += 1
            self._apply_all(self._low)  # type: ignore[arg-type]
        if self.on_change is not None:
            self.on_change(False)

    def close(self) -> None:
        """Called by ``Checkpointer.close`` once the threads have stopped: forget their ids (reusable)."""
        with self._lock:
            self._threads.clear()

    def _apply_all(self, policy: Policy) -> PermissionError | None:
        """Under the lock: give every live enlisted thread ``policy``; the kernel's refusal, if any."""
        for tid, thread in list(self._threads.items()):
            if not thread.is_alive():  # its id may belong to another thread by now
                del self._threads[tid]
                continue
            try:
                self._set(tid, policy)
            except PermissionError as e:
                return e
        return None

    def _set(self, tid: int, policy: Policy) -> None:
        """Apply ``policy`` to ``tid``; only a refusal (``PermissionError``) reaches the caller."""
        try:
            self._apply(tid, policy)
        except PermissionError:
            raise
        except (AttributeError, OSError) as e:  # a seccomp profile, a thread that just exited
            log.debug("fastckpt: could not set the priority of thread %d to %s: %s", tid, policy, e)

    def _name(self) -> str:
        return "idle" if self._low is not None and self._low.sched == getattr(os, "SCHED_IDLE", None) else "low"
