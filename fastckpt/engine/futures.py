"""Resolving ``concurrent.futures.Future`` objects that more than one thread may resolve.

A save's futures can be failed by ``close()`` (or by a failed local commit) while a worker is still about to
resolve them: the first outcome wins and the later one is dropped, instead of raising ``InvalidStateError`` on a
background thread. Used by the checkpointer and the remote tier, both above this module.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, InvalidStateError
from typing import Any

from ..errors import CheckpointTimeoutError

__all__ = ["settle", "copy_outcome", "succeeded", "remaining", "resolved", "raise_if_left"]


def resolved(result: Any = None) -> Future:
    """A future already resolved to ``result`` (a request this process has nothing to do for)."""
    fut: Future = Future()
    fut.set_result(result)
    return fut


def remaining(deadline: float | None) -> float | None:
    """The seconds left until the ``time.monotonic()`` ``deadline`` (never negative), None for no deadline: what
    is left of one caller's timeout for the next of several waits."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def raise_if_left(left: list[str], timeout: float | None) -> None:
    """``Checkpointer.wait(timeout)``'s verdict: ``CheckpointTimeoutError`` naming what is still pending, if any."""
    if left:
        raise CheckpointTimeoutError(
            f"Checkpointer.wait(timeout={timeout}) expired with {', '.join(left)} still pending; they go on in "
            "the background: call wait() again, or check the storage (a stalled write fails after "
            "network.timeout_s on an fsspec storage)")


def settle(fut: Future, *, result: Any = None, exc: BaseException | None = None) -> None:
    """Resolve ``fut`` unless it already is (close() may have failed it first)."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def succeeded(fut: Future) -> bool:
    """Whether ``fut`` finished with a result (non-blocking)."""
    return fut.done() and not fut.cancelled() and fut.exception() is None


def copy_outcome(src: Future, dst: Future) -> None:
    """Give ``dst`` the outcome of the finished ``src``."""
    exc = src.exception()
    settle(dst, exc=exc) if exc is not None else settle(dst, result=src.result())
