"""fastckpt's background threads never take an asynchronous signal (``quiet``, called by each on itself as it starts).

The kernel hands a signal sent to the process (a scheduler's SIGTERM, SLURM's SIGUSR1, an operator's SIGINT) to its
main thread when that thread can take it, else to any other thread that does not block it, and Python's C-level
handler runs on that thread before the main thread runs the Python handler. fastckpt's I/O and upload threads may run
at the ``idle`` scheduling policy (``persist.priority``, engine/priority.py), which a busy machine may not run for
seconds: a signal handed to one of them would be nobody's until then (the preemption flush, engine/preempt.py, could
end first and hand on only the signals seen). Blocked in every fastckpt thread, such a signal goes to a thread of the
user's, as in a process without fastckpt. This is a hardening, not a fix of a failure seen: the lost second signals
first blamed on it (tests/test_preempt_signals.py, in runs started under ``nohup``) were SIGHUP and SIGINT inherited
as ignored, which fastckpt rightly keeps ignored. Threads started from a blocking thread inherit its mask (torch's
intra-op pool, made lazily by the copy thread), and so would child processes: fastckpt starts its children (the
persister, the compiled pass's warm-up) from the training thread or the warm-up thread, which do not block.
"""
from __future__ import annotations

import signal

__all__ = ["ASYNC_SIGNALS", "quiet"]

ASYNC_SIGNALS = frozenset(getattr(signal, name) for name in (
    "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU", "SIGPWR")
    if hasattr(signal, name))


def quiet() -> None:
    """Block ``ASYNC_SIGNALS`` on the calling thread (a background thread of fastckpt's, as it starts)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, ASYNC_SIGNALS)
