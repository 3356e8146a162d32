"""Handing held signals on: every arrival, in order, to the handler installed before; the strongest ends the process.

fastckpt's preemption handler (engine/preempt.py) holds each signal it catches until the final checkpoint is flushed
or abandoned; this module then hands on what it held (docs/API.md, "Flush on preemption"):

- Every arrival goes, in order of arrival, to the handler that was installed before fastckpt's: a Python handler is
  called (the user's, Lightning's), a signal that was ignored stays ignored.
- A default action that ends the process (SIGTERM's, SIGUSR1's, ...) waits until every arrival was handed on; then
  the process ends with the strongest of those signals (``STRENGTH``), its default action restored, as it would have
  ended without fastckpt: a scheduler sees -15 for a SIGTERM even where a SIGUSR1 came first.
- An exception a Python handler raised (``KeyboardInterrupt`` from Python's SIGINT handler, ``SystemExit``) does not
  stop the later arrivals from being handed on; it is raised after them (the strongest signal's, of several),
  unless a default action ended the process first.
- Only the main thread hands on (Python runs signal handlers and changes them only there): another thread wakes it
  with one of the held signals, counted, so that the wake-up is not taken for an arrival.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Any, Callable, Sequence

__all__ = ["STRENGTH", "SignalChain", "strongest"]

log = logging.getLogger("fastckpt")

STRENGTH = ("SIGTERM", "SIGQUIT", "SIGINT", "SIGHUP")
"""The signals that decide how the process ends when several arrived, strongest first; every other signal is weaker
than these (the first to arrive wins among equals). SIGTERM is what a scheduler sends before SIGKILL: the end it
announces is final. SIGQUIT asks for an end with a core dump, SIGINT is an operator's interrupt, SIGHUP a lost
session; the others (SIGUSR1 and SIGUSR2 of SLURM's ``--signal``, SIGALRM, SIGXCPU) warn of an end still to come."""

# Signals whose default action does not end the process: ignored, continue, stop (signal(7)).
_NOT_ENDING = frozenset(getattr(signal, n) for n in ("SIGCHLD", "SIGURG", "SIGWINCH", "SIGCONT", "SIGTSTP", "SIGTTIN",
                                                     "SIGTTOU") if hasattr(signal, n))
_MAX_HELD_EACH = 64  # arrivals of one signal held at once: a storm of them is not kept without end
_MAX_RECEIVED = 256  # arrivals remembered for reports

Handler = Callable[[int, "FrameType | None"], Any]


def _rank(signum: int) -> int:
    name = signal.Signals(signum).name
    return len(STRENGTH) - STRENGTH.index(name) if name in STRENGTH else 0


def strongest(signums: Sequence[int]) -> int:
    """The strongest of ``signums`` (``STRENGTH``; the first in the sequence among equals)."""
    return max(signums, key=_rank)  # max keeps the first of equal keys


class SignalChain:
    """The handlers fastckpt replaced, and the signals it holds for them until ``drain``."""

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}  # signal -> the handler we replaced
        self.received: list[int] = []  # every arrival held, oldest first (reports)
        self._held: list[int] = []  # arrivals not handed on yet, oldest first
        # signal -> wake-ups sent to the main thread / taken there: each written by one side only (sent under the
        # lock, taken by the handler, which takes no lock), so that no count is lost between two threads
        self._sent: dict[int, int] = {}
        self._taken: dict[int, int] = {}
        self._ending: list[int] = []  # handed on to a default action that ends the process: deferred to the end
        self._raised: list[tuple[int, BaseException]] = []  # what Python handlers raised, raised after the others
        self._draining = False
        self._main_drains = False  # close() on the main thread hands on: no thread wakes it any more
        self._lock = threading.Lock()  # never taken by a signal handler (it runs on the main thread, anywhere)

    # ---- installing -------------------------------------------------------------------------------------

    def install(self, signums: Sequence[int], handler: Handler) -> None:
        """Put ``handler`` in front of each signal's handler (main thread); all or none."""
        try:
            for signum in signums:
                self.previous[signum] = signal.getsignal(signum)
                signal.signal(signum, handler)
        except BaseException:
            self.restore(handler)
            raise

    def restore(self, handler: Handler) -> None:
        """Give back each signal whose handler is still ``handler`` (main thread)."""
        for signum, previous in list(self.previous.items()):
            if signal.getsignal(signum) == handler:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)

    # ---- holding ----------------------------------------------------------------------------------------

    @property
    def held(self) -> bool:
        return bool(self._held)

    def arrived(self, signum: int) -> bool:
        """In the handler: hold this arrival, or, if it is a wake-up ``wake`` sent, return True without holding it."""
        if self._taken.get(signum, 0) < self._sent.get(signum, 0):
            self._taken[signum] = self._taken.get(signum, 0) + 1
            return True
        if self._held.count(signum) < _MAX_HELD_EACH:
            self._held.append(signum)
            if len(self.received) < _MAX_RECEIVED:
                self.received.append(signum)
        return False

    def wake(self) -> None:
        """From a thread other than the main one: make the main thread hand the held signals on (its handler,
        woken by one of them, drains). Nothing when the main thread drains by itself (``main_drains``)."""
        with self._lock:
            first = self._held[:1]  # one read: the main thread may hand them on meanwhile
            if self._main_drains or not first:
                return
            signum = first[0]  # ours is installed for it; a blocking wait on the main thread ends (EINTR)
            self._sent[signum] = self._sent.get(signum, 0) + 1
            signal.pthread_kill(threading.main_thread().ident or 0, signum)

    def main_drains(self) -> None:
        """The main thread will drain by itself (close() there): no wake-up is sent from now on."""
        with self._lock:
            self._main_drains = True

    # ---- handing on (main thread) ---------------------------------------------------------------------------

    def drain(self) -> None:
        """Hand every held arrival on, in order; then end the process with the strongest signal whose default
        action ends it, else raise what a Python handler raised. An arrival during this is handed on too."""
        if self._draining:
            return  # an arrival while handing on: the loop below takes it
        while True:
            self._draining = True
            try:
                while self._held:
                    self._hand_on(self._held.pop(0), None)
            finally:
                self._draining = False
            if not self._held:
                break
        self._settle()

    def pass_on(self, signum: int, frame: FrameType | None) -> None:
        """Hand one signal on at once, holding nothing (a fork()ed child, which inherited our handler)."""
        self._hand_on(signum, frame)
        self._settle()

    def _hand_on(self, signum: int, frame: FrameType | None) -> None:
        previous = self.previous.get(signum, signal.SIG_DFL)
        if callable(previous):
            try:
                previous(signum, frame)
            except BaseException as e:  # noqa: BLE001 - raised once every arrival was handed on
                self._raised.append((signum, e))
        elif previous == signal.SIG_IGN:
            return
        elif signum in _NOT_ENDING:  # the default action ignores, continues or stops: as it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        else:  # SIG_DFL, or None (installed outside Python: the default is the safe guess)
            self._ending.append(signum)

    def _settle(self) -> None:
        ending, self._ending = self._ending, []
        if ending:
            _end_with(strongest(ending), ending)
        raised, self._raised = self._raised, []
        if raised:
            raise max(raised, key=lambda r: _rank(r[0]))[1]


def _end_with(signum: int, ending: list[int]) -> None:
    """End the process with ``signum``'s default action, as it would have ended without fastckpt."""
    names = [signal.Signals(s).name for s in ending]
    log.warning("fastckpt: preemption: handed on %s; the process ends with %s, its default action", ", ".join(names),
                signal.Signals(signum).name)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced: nothing to lose
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # a default action that ends the process takes every thread with it here
