"""Flush on preemption: a signal (or a notice) takes a final checkpoint at the next safe point, then goes on.

The signal handler only records the signal: Python runs it on the main thread between two bytecodes, maybe in the
middle of ``optimizer.step()`` or of fastckpt's own bookkeeping, so it must not save anything there. The final
checkpoint is taken at the next *safe point* on the training thread: the step pre-hook of a watched optimizer
(parameters and optimizer state are consistent there: the step that would change them has not begun) or
``point()``, which the integrations call between batches and a plain loop may call anywhere between steps. It
saves the state ``on_preempt`` returns, waits until it and every pending save is committed (at most until
``grace_s`` after the signal), then hands the signal on: to the handler that was installed before (the user's,
Lightning's SLURM requeue), or, where that was the default action, restores it and raises the signal again, so
the process dies as it would have. A watcher thread hands the signal on at the deadline if no safe point came
(the training thread blocked in data loading, say): a signal is never swallowed.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import weakref
from types import FrameType
from typing import Any, Callable, Protocol

from ..config import PreemptionOptions
from ..errors import ConfigError, FastCkptError

__all__ = ["Preemption", "StateSource"]

log = logging.getLogger("fastckpt")

_NOTICE_POLL_S = 0.5  # how often the watcher looks for preemption.notice_file (one stat() call)

# What ``on_preempt`` registers: returns the state to save and its step.
StateSource = Callable[[], "tuple[Any, int]"]


class _Saves(Protocol):
    """The public surface of the Checkpointer this needs."""

    def save(self, state: Any, step: int, *, name: str | None = None, eager: Any = (), lazy: Any = ()) -> Any: ...
    def wait(self, timeout: float | None = None) -> None: ...
    def pending_names(self) -> list[str]: ...
    def exists(self, name: str) -> bool: ...


class Preemption:
    """One Checkpointer's preemption handling; ``enabled`` installs it (``close()`` removes it)."""

    def __init__(self, options: PreemptionOptions, saves: _Saves | None = None) -> None:
        """``saves``: the Checkpointer that saves ``on_preempt``'s state; an integration passes None and registers
        its own final checkpoint with ``on_preempt_run``."""
        self.options = options
        # the handler and the watcher must not keep a Checkpointer alive
        self._saves: Callable[[], _Saves | None] = weakref.ref(saves) if saves is not None else lambda: None
        self._run: Callable[[float], None] | None = None
        self._owner = os.getpid()  # a fork()ed child (a DataLoader worker) inherits the handler, not the threads
        self._source: StateSource | None = None
        self._previous: dict[int, Any] = {}  # signal -> the handler we replaced, to chain to
        self._forward: set[int] = set()  # signals the watcher re-raised for the main thread to hand on
        self._signum: int | None = None  # the recorded signal (0 for a notice)
        self._reason = ""
        self._deadline = 0.0
        self._recorded = threading.Event()
        self._done = threading.Event()  # the final checkpoint was handled (flushed, or given up)
        self._stop = threading.Event()
        self._wake = threading.Event()  # wakes the watcher: a preemption recorded, or close()
        self._lock = threading.Lock()  # one safe point runs the final checkpoint, never two threads
        self.flush_s: float | None = None  # how long the final checkpoint and the flush took
        self.final_step: int | None = None  # the step of the final checkpoint, None if none was taken
        self._watcher: threading.Thread | None = None
        if options.enabled:
            self._install()

    # ---- what users and integrations call -------------------------------------------

    def on_preempt(self, source: StateSource | None) -> None:
        """Register what to save at a preemption: ``source()`` returns ``(state, step)``, called on the training
        thread at the safe point. Without one, a preemption only flushes the saves already pending."""
        if source is not None and not callable(source):
            raise ConfigError(f"on_preempt() takes a callable returning (state, step), got {type(source).__name__}")
        self._source = source

    def on_preempt_run(self, run: Callable[[float], None] | None) -> None:
        """Register an integration's own final checkpoint: ``run(timeout)`` saves, then waits at most ``timeout``
        seconds for it and every pending save to be durable (Lightning: ``trainer.save_checkpoint``, then the flush)."""
        self._run = run

    @property
    def preempted(self) -> bool:
        """Whether a preemption signal or notice was recorded."""
        return self._recorded.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a preemption is recorded (at most ``timeout``); returns whether one was."""
        return self._recorded.wait(timeout)

    def notify(self, reason: str = "notify()") -> None:
        """Record a preemption notice (a spot-instance or maintenance notice found by the user's own check)."""
        self._record(0, reason)

    def point(self) -> bool:
        """A safe point: if a preemption was recorded and not yet handled, take the final checkpoint now, flush
        everything, then hand the signal on (which may end the process). Returns whether it ran here."""
        if os.getpid() != self._owner or not self._recorded.is_set() or self._done.is_set():
            return False
        if not self._lock.acquire(blocking=False):
            return False  # another thread runs it now
        try:
            if self._done.is_set():
                return False
            self._final()
        finally:
            self._done.set()
            self._lock.release()
        if self._signum:
            self._hand_on(self._signum)
        return True

    def before_step(self, then: Callable[[], None]) -> None:
        """A watched optimizer's step pre-hook: the safe point, then ``then`` (the owner's ``wait_staged``)."""
        self.point()
        then()  # returns None: torch reads a pre-hook's return value as new (args, kwargs)

    def close(self) -> None:
        """Stop watching: restore the handlers we replaced (where ours is still installed)."""
        self._stop.set()
        self._wake.set()
        if os.getpid() != self._owner or threading.current_thread() is not threading.main_thread():
            return  # signal.signal works only on the main thread; ours then stays, passing signals on
        for signum, previous in list(self._previous.items()):
            if signal.getsignal(signum) == self._handler:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    # ---- internals ----------------------------------------------------------------------

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError("preemption.enabled installs signal handlers, which Python allows only on the main "
                              "thread: build the Checkpointer on the main thread, or set preemption.enabled: false")
        for name in self.options.signals:
            signum = int(getattr(signal, name))
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handler)
        self._watcher = threading.Thread(target=self._watch, name="fastckpt-preempt", daemon=True)
        self._watcher.start()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        """Only records (see the module docstring); hands on what is not ours to handle."""
        if os.getpid() != self._owner or signum in self._forward or self._done.is_set():
            self._forward.discard(signum)
            self._call_previous(signum, frame)
            return
        self._record(signum, signal.Signals(signum).name)

    def _record(self, signum: int, reason: str) -> None:
        if self._recorded.is_set():
            return
        self._signum, self._reason = signum, reason
        self._deadline = time.monotonic() + self.options.grace_s
        self._recorded.set()  # last: point() reads the fields above once this is set
        self._wake.set()

    def _watch(self) -> None:
        """Watch the notice file; past the deadline with no safe point, hand the signal on anyway."""
        notice = self.options.notice_file
        while not self._recorded.is_set():
            if notice is not None and os.path.exists(notice):
                self._record(0, f"notice file {notice}")
                break
            self._wake.wait(_NOTICE_POLL_S if notice is not None else None)
            if self._stop.is_set():
                return
        log.warning("fastckpt: preemption (%s): final checkpoint at the next safe point, within %.1fs",
                    self._reason, self.options.grace_s)
        if self._done.wait(max(0.0, self._deadline - time.monotonic())) or self._stop.is_set():
            return
        log.error("fastckpt: preemption (%s): no safe point (an optimizer step or point()) came within "
                  "preemption.grace_s=%.1fs; handing the signal on without a final checkpoint",
                  self._reason, self.options.grace_s)
        if self._lock.acquire(blocking=False):  # else the training thread reached a safe point just now
            self._done.set()
            self._lock.release()
            if self._signum:
                self._hand_on(self._signum)

    def _final(self) -> None:
        """Save the state ``on_preempt`` returns (copied inside save(): the process is about to die), then wait
        for it and every pending save until the deadline. Errors are logged: the signal goes on regardless."""
        t0 = time.monotonic()
        saves = self._saves()
        try:
            if self._run is not None:
                self._run(max(0.0, self._deadline - time.monotonic()))
            elif saves is None:
                log.warning("fastckpt: preemption: nothing registered to save (on_preempt_run)")
            elif self._source is not None:
                state, step = self._source()
                # Its own name even where step-N was saved: buffers (BatchNorm's) and the user's own values may
                # have changed since. It sorts after step-N, so load() and latest() pick it at that step.
                saves.save(state, step, name=f"step-{step:09d}-preempt", eager="*")
                self.final_step = step
            else:
                log.warning("fastckpt: preemption: no on_preempt() source registered; flushing pending saves only")
            if saves is not None:
                saves.wait(timeout=max(0.0, self._deadline - time.monotonic()))
        except FastCkptError as e:
            log.error("fastckpt: preemption (%s): final checkpoint not durable within grace_s: %s", self._reason, e)
        except Exception as e:  # noqa: BLE001 - the user's source failed: still hand the signal on
            log.error("fastckpt: preemption (%s): final checkpoint failed: %r", self._reason, e)
        self.flush_s = time.monotonic() - t0
        log.warning("fastckpt: preemption (%s): final checkpoint and flush took %.2fs", self._reason, self.flush_s)

    def _hand_on(self, signum: int) -> None:
        """Give the signal to whoever handled it before us; from another thread, through the main thread."""
        if threading.current_thread() is threading.main_thread():
            self._call_previous(signum, None)
        else:  # only the main thread may restore SIG_DFL: our handler, seeing _forward, hands it on there
            self._forward.add(signum)
            # to the main thread itself: a blocking wait there is interrupted (EINTR) only if it gets the signal
            signal.pthread_kill(threading.main_thread().ident or 0, signum)

    def _call_previous(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):  # None: installed outside Python; the default is the safe guess
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # dies now, as the signal's default action would have
