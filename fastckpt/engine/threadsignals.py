"""fastckpt's background threads never take an asynchronous signal (``quiet``, called by each on itself as it starts).

The kernel hands a signal sent to the process (a scheduler's SIGTERM, SLURM's SIGUSR1, an operator's SIGINT) to any
one of its threads that does not block it, and Python's C-level handler runs on that thread before the main thread
can run the Python handler. fastckpt's I/O and upload threads may run at the ``idle`` scheduling policy
(``persist.priority``, engine/priority.py): on a busy machine one of them picked for a signal may not run for
seconds, and until it does the signal is nobody's. Measured beside two CPU-bound processes: a second signal sent
during the preemption flush (engine/preempt.py) was still unhandled when the flush ended, so the process ended with
the first signal's status, or ran on and exited 0 with a SIGINT never seen. Blocked in every fastckpt thread, such a
signal goes to a thread of the user's (the main thread, the one that handles it), as in a process without fastckpt.
Threads started from a blocking thread inherit its mask (torch's intra-op pool, made lazily by the copy thread);
child processes are started from the training thread or the warm-up thread (format/fused.py), which do not block.
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
