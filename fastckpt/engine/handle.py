"""``SaveHandle``: the two awaitable phases of one save, plus its figures."""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from ..errors import FastCkptError
from ..format.layout import CheckpointInfo
from .streams import gpu_wait, host_wait, pending

__all__ = ["SaveHandle", "SaveStats"]

log = logging.getLogger("fastckpt")


@dataclass(slots=True)
class SaveStats:
    """Figures of one save. Times are measured from the start of ``save()``.

    ``waited_ms`` is the time callers spent blocked in ``wait_staged`` for this save (the
    optimizer pre-hook included): the stall the lazy copy cost the training thread, host waits on
    CUDA copies (``host=True``) included. ``gpu_waits`` counts the ``wait_staged`` calls that
    ordered the device's next kernels after CUDA copies still running: a GPU-side stall no host
    clock sees (0 when every copy was done before the next step).
    ``staging_ms`` is when the host copy was complete. On CUDA the copies are asynchronous and it
    is when an I/O worker saw the last one done: an upper bound, later if the workers were busy.
    ``nbytes`` is the size of the whole checkpoint (known on the committing rank); ``written_bytes``
    what this process wrote (all of it, unless ``distributed=True`` ranks share the writes).
    ``device_snapshot``: the CUDA tensors were copied on their device inside ``save()`` and staged from that copy
    (``staging.device_snapshot``); False for the live tensors (``off``, no room, a CPU state).
    """

    step: int
    name: str
    blocking_ms: float = 0.0
    staging_ms: float = 0.0
    waited_ms: float = 0.0
    gpu_waits: int = 0
    persist_s: float = 0.0
    nbytes: int = 0
    written_bytes: int = 0
    skipped: bool = False
    device_snapshot: bool = False

    @property
    def throughput_mb_s(self) -> float:
        return self.nbytes / 1e6 / self.persist_s if self.persist_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "blocking_ms": self.blocking_ms,
            "staging_ms": self.staging_ms,
            "waited_ms": self.waited_ms,
            "gpu_waits": float(self.gpu_waits),
            "persist_s": self.persist_s,
            "nbytes": float(self.nbytes),
            "written_bytes": float(self.written_bytes),
            "throughput_mb_s": self.throughput_mb_s,
            "device_snapshot": float(self.device_snapshot),
        }


@dataclass(eq=False)
class SaveHandle:
    """Returned by ``Checkpointer.save``. ``wait_staged`` then ``wait`` (then ``wait_uploaded`` with a remote tier)."""

    name: str
    step: int
    path: str
    stats: SaveStats
    skipped: bool = False
    _staged: threading.Event = field(default_factory=threading.Event)
    _cuda_events: list = field(default_factory=list)  # (device, event) of each queued device-to-host copy
    _durable: Future = field(default_factory=Future)
    _on_error_seen: Callable[["SaveHandle"], None] | None = None
    _upload: Future | None = None  # set when this save is also uploaded to the remote tier
    _sealed: threading.Event = field(default_factory=threading.Event)
    _sealer: Callable[[], Callable[[], None] | None] | None = None  # a lazy save's seal (engine/pipeline.py)
    _on_block: Callable[[], None] | None = None  # before blocking on the background threads: raise them
    # set once a caller blocks on staging (the training thread at its optimizer step, mostly): the copy thread then
    # stages the rest plainly, leaving the checksums and statistics to the I/O workers (engine/onepass.py)
    hurry: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    """When ``save()`` built this handle (``time.monotonic()``): how long persistence lags is measured from it."""

    def wait_staged(self, timeout: float | None = None, *, host: bool = False) -> None:
        """Block until the copies are queued: the source tensors may change after this (see docs/API.md).

        On CUDA the copies may still run: later work on each source device's *current stream* is
        ordered after them, without blocking the host; other streams are not. ``host=True`` also
        blocks until they are done (the host buffers are complete), which orders every stream.
        """
        if not self._staged.is_set():
            t0 = time.perf_counter()
            self.hurry.set()
            done = self._staged.wait(timeout)
            self.stats.waited_ms += (time.perf_counter() - t0) * 1e3
        else:
            done = True
        if not done:
            raise TimeoutError(f"checkpoint {self.name!r} was not staged within {timeout}s")
        self.seal()
        if self._cuda_events:
            if host:
                t0 = time.perf_counter()
                host_wait(self._cuda_events)
                self.stats.waited_ms += (time.perf_counter() - t0) * 1e3
            else:  # GPU-side ordering: kernels queued next on each device wait, the host does not
                gpu_wait(self._cuda_events)
            # every optimizer step calls this for every pending save: finished copies need no wait again
            self._cuda_events = pending(self._cuda_events)
            if self._cuda_events and not host:
                self.stats.gpu_waits += 1  # the next kernels really wait: copies were still running

    def seal(self) -> None:
        """Once staged, prove on this (the training) thread that no lazy source moved since ``save()``; the
        commit waits for it (fastckpt/engine/seal.py). Called by ``wait_staged``, ``wait``, ``close`` and the
        next ``save``; a no-op for an eager save or once sealed."""
        if self._sealed.is_set():
            return
        if not self._staged.is_set():
            self.hurry.set()
            self._staged.wait()
        sealer, self._sealer = self._sealer, None
        after = None
        try:
            if sealer is not None:
                after = sealer()
        finally:
            self._sealed.set()  # the committer goes on: commits, or fails the refused snapshot
        if after is not None:
            after()  # the retake (staging.on_mutation: retake), once the refused snapshot is cleared away

    def wait_copied(self, timeout: float | None = None) -> bool:
        """Block until staging is done, without hurrying the copy thread (its one pass goes on) and without the
        seal: True once staged. For measurements; training calls ``wait_staged``."""
        return self._staged.wait(timeout)

    def staged(self) -> bool:
        """Whether staging finished (non-blocking)."""
        return self._staged.is_set()

    def wait(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Block until committed; raises the background error (and marks it reported)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._staged.is_set():
            self.hurry.set()
        if self._staged.wait(timeout):  # a lazy save commits once sealed, here on the caller's thread
            self.seal()
        self.blocking()
        try:
            return self._durable.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except FastCkptError:
            if self._on_error_seen is not None:
                self._on_error_seen(self)
            raise

    def blocking(self) -> None:
        """Called before blocking on this save's commit (``wait`` does; so must code that waits on ``durable``
        itself: a loader reading the file being saved, a logger delivering in order). The background threads run
        at the caller's priority from here (``persist.priority``): a caller at normal priority waiting on ``idle``
        threads that a host with busy cores never runs would wait for minutes (a priority inversion)."""
        settled = self._durable.done() and (self._upload is None or self._upload.done())
        if self._on_block is not None and not settled:
            self._on_block()

    def done(self) -> bool:
        """Whether the save finished, successfully or not."""
        return self._durable.done()

    def wait_uploaded(self, timeout: float | None = None) -> CheckpointInfo | None:
        """Block until the remote copy is committed; returns its ``CheckpointInfo``.

        Raises the local or the upload error (and marks it reported). Without a remote
        tier (or on ranks other than 0) this is ``wait()``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        info = self.wait(timeout)
        if self._upload is None:
            return info
        try:
            return self._upload.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except FastCkptError:
            if self._on_error_seen is not None:
                self._on_error_seen(self)
            raise

    def uploaded(self) -> bool:
        """Whether ``wait_uploaded()`` would return now without raising (non-blocking)."""
        for fut in (self._durable, self._upload):
            if fut is not None and (not fut.done() or fut.cancelled() or fut.exception() is not None):
                return False
        return True

    @property
    def durable(self) -> Future:
        """The commit as a ``Future`` (its result the ``CheckpointInfo``, None for a skipped save or on ranks that
        do not commit), for ``concurrent.futures.wait`` and done-callbacks. Reading its error through the future
        does not mark it reported: ``wait()`` does, so the next ``save``/``wait``/``close`` still raises it."""
        return self._durable

    @property
    def upload(self) -> Future | None:
        """The commit of the remote copy as a ``Future``, when the remote tier uploads this save; else None."""
        return self._upload

    # ---- called by the engine (engine/saver.py, engine/pipeline.py) and the tiers, never by users -----------

    def expect_upload(self) -> Future:
        """Called before the commit of a save the remote tier will upload: the future ``wait_uploaded`` waits
        for (made once)."""
        if self._upload is None:
            self._upload = Future()
        return self._upload

    def track_copies(self, events: list) -> None:
        """Called by the engine with the (device, event) of each queued device-to-host copy: ``wait_staged``
        orders the caller's streams after them."""
        self._cuda_events = events

    def mark_staged(self) -> None:
        """Called by the engine once every copy is queued (and, with shared memory, recorded): releases
        ``wait_staged``."""
        self._staged.set()

    def await_staging(self) -> None:
        """Called by the committer: block until ``mark_staged`` and the seal, counting no wait in the figures."""
        self._staged.wait()
        self._sealed.wait()

    def needs_seal(self, sealer: Callable[[], Callable[[], None] | None]) -> None:
        """Called by the engine when a lazy snapshot is queued: ``sealer`` runs at the seal, on the training
        thread, and returns what to run once the seal is released (a retake), if anything."""
        self._sealer = sealer

    def sealed_now(self) -> None:
        """Called by the engine for a snapshot with nothing lazy: no seal to wait for."""
        self._sealed.set()

    def set_committed(self, info: CheckpointInfo | None) -> None:
        """Called by the committer (or for a skipped save) once, last: ``wait()`` returns ``info``."""
        self._durable.set_result(info)

    def set_failed(self, err: FastCkptError) -> None:
        """Called by the committer once, last: ``wait()`` raises ``err``."""
        self._durable.set_exception(err)

    def add_done_callback(self, fn: Callable[["SaveHandle"], None]) -> None:
        """Call ``fn(handle)`` after commit or failure, on the committer thread (or now if done)."""
        def call(_: Future) -> None:
            try:
                fn(self)
            except Exception:  # a user callback must not kill the committer
                log.exception("fastckpt: done-callback for %s raised", self.name)
        self._durable.add_done_callback(call)
