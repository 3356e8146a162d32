"""Flush on preemption: a signal (or a notice) takes a final checkpoint at the next safe point, then goes on.

The signal handler only records the signal: Python runs it on the main thread between two bytecodes, maybe in the
middle of ``optimizer.step()`` or of fastckpt's own bookkeeping, so it must not save anything there. The final
checkpoint is taken at the next *safe point* on the training thread: the step pre-hook of a watched optimizer
(parameters and optimizer state are consistent there: the step that would change them has not begun), ``point()``,
which the integrations call between batches and a plain loop may call anywhere between steps, or ``finish()``, the
owner's last one (``Checkpointer.close``). It saves the state ``on_preempt`` returns, waits until it and every
pending save is committed (at most until ``grace_s`` after the signal), then hands every signal that arrived on, in
order (engine/signalchain.py): to the handler that was installed before (the user's, Lightning's SLURM requeue), or,
where that was the default action, the process ends with the strongest of them, as it would have. A signal is never
swallowed: a watcher thread hands them on at the deadline if no safe point came (the training thread blocked in
data loading, say), and ``close()`` (after the owner's flush) and the interpreter's exit hand on what is still held.
"""
from __future__ import annotations

import atexit
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
from .signalchain import SignalChain

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
    """One Checkpointer's preemption handling; ``enabled`` installs it, ``close()`` hands on what it holds and
    removes it."""

    def __init__(self, options: PreemptionOptions, saves: _Saves | None = None) -> None:
        """``saves``: the Checkpointer that saves ``on_preempt``'s state; an integration passes None and registers
        its own final checkpoint with ``on_preempt_run``."""
        self.options = options
        # the handler and the watcher must not keep a Checkpointer alive
        self._saves: Callable[[], _Saves | None] = weakref.ref(saves) if saves is not None else lambda: None
        self._run: Callable[[float], None] | None = None
        self._owner = os.getpid()  # a fork()ed child (a DataLoader worker) inherits the handler, not the threads
        self._source: StateSource | None = None
        self._chain = SignalChain()  # the handlers we replaced, and the signals held for them until the flush ends
        self._reason = ""
        self._deadline = 0.0
        self._recorded = threading.Event()
        self._done = threading.Event()  # the final checkpoint was handled (flushed, or given up)
        self._stop = threading.Event()
        self._wake = threading.Event()  # wakes the watcher: a preemption recorded, or close()
        self._lock = threading.Lock()  # one safe point runs the final checkpoint, never two threads
        self._closed = False
        self.flush_s: float | None = None  # how long the final checkpoint and the flush took
        self.final_step: int | None = None  # the step of the final checkpoint, None if none was taken
        self._watcher: threading.Thread | None = None
        if options.enabled:
            self._install()

    @staticmethod
    def check_installable(options: PreemptionOptions) -> None:
        """``ConfigError`` if ``options`` would install signal handlers off the main thread, which Python refuses:
        an owner calls it before it starts anything, so a refused constructor leaves nothing behind."""
        if options.enabled and threading.current_thread() is not threading.main_thread():
            raise ConfigError("preemption.enabled installs signal handlers, which Python allows only on the main "
                              "thread: build the Checkpointer on the main thread, or set preemption.enabled: false")

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

    @property
    def received(self) -> list[str]:
        """The names of the signals caught, in order of arrival (each is handed on once the flush ends)."""
        return [signal.Signals(s).name for s in self._chain.received]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a preemption is recorded (at most ``timeout``); returns whether one was."""
        return self._recorded.wait(timeout)

    def notify(self, reason: str = "notify()") -> None:
        """Record a preemption notice (a spot-instance or maintenance notice found by the user's own check)."""
        self._record(0, reason)

    def point(self) -> bool:
        """A safe point: if a preemption was recorded and not yet handled, take the final checkpoint now, flush
        everything, then hand the signals on (which may end the process). Returns whether it ran here."""
        if not self.finish():
            return False
        self._hand_on()
        return True

    def finish(self) -> bool:
        """The owner's last safe point (``Checkpointer.close`` calls it while it still saves): take the final
        checkpoint of a preemption recorded and not yet handled, and flush, without handing the signals on; the
        owner's ``close()`` does, after its own flush. Returns whether it ran here."""
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
        return True

    def before_step(self, then: Callable[[], None]) -> None:
        """A watched optimizer's step pre-hook: the safe point, then ``then`` (the owner's ``wait_staged``)."""
        self.point()
        then()  # returns None: torch reads a pre-hook's return value as new (args, kwargs)

    def close(self) -> None:
        """Stop watching, then hand on every signal still held: a preemption recorded after the last safe point
        is given up (no final checkpoint unless the owner's ``finish()`` took it), never swallowed. On the main
        thread the handlers we replaced are restored (where ours is still installed) once the signals went on;
        elsewhere the main thread is woken to hand them on, and ours stays, passing later signals on."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if os.getpid() != self._owner:
            return  # a fork()ed child: the parent's signals are the parent's to hand on
        main = threading.current_thread() is threading.main_thread()
        if main:
            self._chain.main_drains()
        if self._recorded.is_set() and not self._done.is_set():
            # a safe point on another thread may be taking the final checkpoint: it ends by the deadline
            got = self._lock.acquire(timeout=max(0.0, self._deadline - time.monotonic()))
            if not self._done.is_set():
                log.error("fastckpt: preemption (%s): closed before a safe point took the final checkpoint; "
                          "handing the signal on with the saves flushed so far", self._reason)
            self._done.set()
            if got:
                self._lock.release()
        if not main:
            self._chain.wake()
            return
        try:
            self._chain.drain()  # may end the process, or raise what a handler raised (KeyboardInterrupt)
        finally:
            self._chain.restore(self._handler)

    # ---- internals ----------------------------------------------------------------------

    def _install(self) -> None:
        self.check_installable(self.options)
        self._chain.install([int(getattr(signal, name)) for name in self.options.signals], self._handler)
        self._watcher = threading.Thread(target=self._watch, name="fastckpt-preempt", daemon=True)
        self._watcher.start()
        # After the owners' own exit flushes (threading's exit hooks run before atexit's): what is still held goes on
        atexit.register(_close_at_exit, weakref.ref(self), self._owner)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        """Only records and holds (see the module docstring); once the flush ended, hands on at once."""
        if os.getpid() != self._owner:  # a fork()ed child (a DataLoader worker): straight on, as if we were not here
            self._chain.pass_on(signum, frame)
            return
        if not self._chain.arrived(signum):  # an arrival (not a wake-up from another thread): held
            self._record(signum, signal.Signals(signum).name)
        if self._done.is_set() or self._closed:  # the flush ended (or this is its wake-up): all held goes on, in order
            self._chain.drain()

    def _record(self, signum: int, reason: str) -> None:
        if self._recorded.is_set():
            return
        self._reason = reason
        self._deadline = time.monotonic() + self.options.grace_s
        self._recorded.set()  # last: point() reads the fields above once this is set
        self._wake.set()

    def _watch(self) -> None:
        """Watch the notice file; past the deadline with no safe point, hand the signals on anyway."""
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
            return  # handed on by the safe point, or close() does it
        log.error("fastckpt: preemption (%s): no safe point (an optimizer step or point()) came within "
                  "preemption.grace_s=%.1fs; handing the signal on without a final checkpoint",
                  self._reason, self.options.grace_s)
        if self._lock.acquire(blocking=False):  # else the training thread reached a safe point just now
            self._done.set()
            self._lock.release()
            self._chain.wake()

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

    def _hand_on(self) -> None:
        """Every held signal goes on: from the main thread at once, else through it (its handler drains)."""
        if threading.current_thread() is threading.main_thread():
            self._chain.drain()
        else:
            self._chain.wake()


def _close_at_exit(ref: "weakref.ref[Preemption]", owner: int) -> None:
    preemption = ref()
    if preemption is not None and os.getpid() == owner:
        preemption.close()
