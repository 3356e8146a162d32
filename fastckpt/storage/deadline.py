"""Deadlines and bounded retries for the requests an fsspec storage sends.

A silently partitioned network never answers, and the libraries below us wait a long time:
botocore retries each request with its own timeouts (60 s by default), and s3fs retries
botocore's failures again. One stalled upload then holds a staging slot for many minutes,
and ``save()`` blocks on that slot. So every request runs under a deadline that fastckpt
enforces itself:

- on an async filesystem (s3fs, gcsfs) the coroutine is cancelled on fsspec's event loop at
  the deadline (``asyncio.wait_for``), which also drops its connection;
- on a blocking one the call runs on a short-lived ``fastckpt-net-*`` thread that is
  abandoned at the deadline: a thread stuck in a socket cannot be stopped from outside, and
  the caller must not wait for it.

A transient failure (a timeout, a reset or refused connection) is retried ``retries`` times
with exponential backoff; any other failure (missing file, access denied) is raised at once.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Awaitable, Callable, TypeVar

from ..config import NetworkOptions
from ..errors import CheckpointTimeoutError, MissingCredentialsError, StorageError

__all__ = ["Deadline", "is_transient", "in_thread", "storage_error", "describe"]

log = logging.getLogger("fastckpt")
T = TypeVar("T")

# ... and what s3fs makes of 503 SlowDown/ServiceUnavailable (EBUSY) and 500 InternalError (EREMOTEIO)
_TRANSIENT_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT,
                               errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EBUSY,
                               errno.EAGAIN, errno.EREMOTEIO})
# botocore/aiohttp errors do not derive from the built-in ConnectionError/TimeoutError: match their names
_TRANSIENT_NAMES = ("Timeout", "Connect", "Connection", "ServerDisconnected", "ClientPayload", "IncompleteRead",
                    "HTTPClientError")
_HTTP_LIBS = frozenset({"botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "s3fs", "fsspec"})
_FINAL = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def is_transient(e: BaseException) -> bool:
    """Whether retrying after ``e`` may help: timeouts and dropped, reset or refused connections."""
    if isinstance(e, _FINAL):
        return False
    cur: BaseException | None = e
    for _ in range(8):  # the cause chain: s3fs and fsspec wrap the network error
        if cur is None:
            return False
        if isinstance(cur, (TimeoutError, ConnectionError)):
            return True
        if isinstance(cur, OSError) and cur.errno in _TRANSIENT_ERRNOS:
            return True
        if any(c.__module__.split(".")[0] in _HTTP_LIBS and any(n in c.__name__ for n in _TRANSIENT_NAMES)
               for c in type(cur).__mro__):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


@dataclass(frozen=True, slots=True)
class Deadline:
    """How one storage runs its requests: ``timeout_s`` each, ``retries`` more after a transient failure."""

    timeout_s: float
    retries: int
    backoff_s: float

    @classmethod
    def of(cls, options: NetworkOptions | None) -> "Deadline":
        o = options if options is not None else NetworkOptions()
        return cls(float(o.timeout_s), o.retries, float(o.backoff_s))

    @property
    def attempts(self) -> int:
        return self.retries + 1

    def call(self, what: str, attempt: Callable[[float], T], *, retry_timeouts: bool = True) -> T:
        """Run ``attempt(timeout_s)`` (which must give up after ``timeout_s``) until it succeeds, fails
        for good, or the retries are spent; the last error is raised as is.

        ``retry_timeouts=False``: an attempt abandoned at its deadline may still be running, so one
        that reads memory its caller reuses afterwards (a staging buffer) must not be raced by a retry.
        """
        for n in range(self.attempts):
            try:
                return attempt(self.timeout_s)
            except Exception as e:
                if n == self.retries or not is_transient(e) or (not retry_timeouts and isinstance(e, TimeoutError)):
                    raise
                self._note_retry(what, e, n)
                _BACKOFF.wait(self._backoff(n))
        raise AssertionError("unreachable")

    async def acall(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """``call`` for a coroutine on fsspec's event loop (one multipart part, one abort)."""
        for n in range(self.attempts):
            try:
                return await asyncio.wait_for(attempt(), self.timeout_s)
            except Exception as e:
                if n == self.retries or not is_transient(e):
                    raise
                self._note_retry(what, e, n)
                await asyncio.sleep(self._backoff(n))  # backoff before a retry, not a synchronization
        raise AssertionError("unreachable")

    def _backoff(self, n: int) -> float:
        return self.backoff_s * 2 ** n

    def _note_retry(self, what: str, e: BaseException, n: int) -> None:
        log.warning("fastckpt: %s failed (%s: %s); retry %d of %d in %.1fs", what, type(e).__name__, e, n + 1,
                    self.retries, self._backoff(n))


# Never set: waiting on it is an interruptible-free pause between attempts on a blocking thread.
_BACKOFF = threading.Event()


def in_thread(fn: Callable[[], T], timeout_s: float, name: str) -> T:
    """Run ``fn`` on a new daemon thread; raise ``TimeoutError`` after ``timeout_s`` and leave it behind.

    Only for blocking fsspec backends: their calls cannot be cancelled, and a caller (an I/O worker
    holding a staging slot) must get its answer by the deadline.
    """
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut.result(timeout_s)  # concurrent.futures.TimeoutError is TimeoutError since 3.11


def describe(e: BaseException) -> str:
    """``e`` as ``Type: message`` (a bare TimeoutError has an empty message)."""
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def storage_error(op: str, path: str, e: BaseException, deadline: Deadline | None = None) -> StorageError:
    """The ``StorageError`` for ``op`` on ``path`` failing with ``e``; past a deadline, a ``CheckpointTimeoutError``."""
    if MissingCredentialsError.caused(e):  # the client's "Unable to locate credentials" says nothing of what to set
        return MissingCredentialsError(f"{op} {path!r} failed: {MissingCredentialsError.fix()}")
    if deadline is not None and isinstance(e, TimeoutError):
        err: StorageError = CheckpointTimeoutError(
            f"{op} {path!r} failed: no answer within the {deadline.timeout_s:g}s deadline of network.timeout_s "
            f"(retried up to network.retries={deadline.retries} time(s)). The storage endpoint is unreachable or "
            f"stalled: check it and the network, or raise network.timeout_s / network.retries")
    else:
        err = StorageError(f"{op} {path!r} failed: {describe(e) if deadline is not None else e}")
    if isinstance(e, OSError):
        err.errno = e.errno
    return err
