"""The publisher: one named thread that runs pointer writes and removals strictly in submission order.

Ordering is the point. A removal queued after a save runs only once that save's pointer is written, which is what
Lightning's own ``AsyncCheckpointIO`` gets wrong (Lightning #14035: removing a file that is still being written is a
no-op, and the file appears afterwards and leaks).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

from fastckpt.errors import FastCkptError, StorageError

log = logging.getLogger(__name__)

THREAD_NAME = "fastckpt-lightning-publish"


class Publisher:
    """A one-worker FIFO job runner that keeps the first background error until someone raises it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None
        self._error: Optional[FastCkptError] = None

    def submit(self, job: Callable[[], None], what: str) -> Future:
        """Queue ``job`` behind every earlier job. ``what`` names it in error messages. Called by the plugin."""
        with self._lock:
            if self._executor is None:
                # One worker gives FIFO order for free; its thread is named and owned by this object.
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
            return self._executor.submit(self._run, job, what)

    def drain(self) -> None:
        """Block until every job submitted so far has run (errors are kept, not raised)."""
        with self._lock:
            executor = self._executor
        if executor is not None:
            executor.submit(lambda: None).result()

    def raise_error(self) -> None:
        """Raise the first background error, exactly once."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Run the queued jobs, then stop the thread. Idempotent; the next submit starts a new thread."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def _run(self, job: Callable[[], None], what: str) -> None:
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - every failure must reach the training thread
            self._record(e, what)

    def _record(self, error: BaseException, what: str) -> None:
        if not isinstance(error, FastCkptError):
            wrapped = StorageError(f"fastckpt_lightning: {what} failed in the background: {error!r}")
            wrapped.__cause__ = error
            error = wrapped
        with self._lock:
            if self._error is None:
                self._error = error
                return
        # Only the first error is raised; later ones would mostly be consequences of it.
        log.error("fastckpt_lightning: another background error after the first one: %s", error)
