"""Exit hooks that run only in the process that registered them.

A ``fork()``ed child (a DataLoader worker, a ``multiprocessing`` 'fork' Process) inherits
every exit hook of its parent, but none of its threads: a hook that flushes the parent's
saves would wait in the child for a copy or commit thread that does not exist there, so
every worker would linger until a timeout at exit. Each hook therefore remembers the pid
that registered it and does nothing elsewhere.
"""
from __future__ import annotations

import atexit
import os
import threading
from typing import Callable

__all__ = ["register_exit_hook"]


def register_exit_hook(hook: Callable[[], None]) -> None:
    """Run ``hook`` at interpreter exit of this process only, while thread pools still accept work.

    ``atexit`` handlers run after threading's exit hooks, and one of those shuts down every
    ``concurrent.futures`` executor, so a lazy copy still pending would fail to queue its
    writes. ``threading._register_atexit`` hooks run newest first, before that one.
    """
    owner = os.getpid()

    def run_in_owner() -> None:
        if os.getpid() == owner:  # never in a fork()ed child: the threads it would wait for live in the parent
            hook()

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(run_in_owner)
            return
        except RuntimeError:  # shutdown already started
            pass
    atexit.register(run_in_owner)
