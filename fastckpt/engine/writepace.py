"""Write pacing (``persist.pace_writes``): the I/O workers hand shards to storage no faster than it sustains.

A token bucket in bytes, refilled at the write bandwidth measured on this process's own shard writes (bytes over
seconds, an exponentially weighted mean, so a slower disk or a busier host is followed). A worker takes a
shard's bytes from the bucket before writing it and sleeps while it is short, so the writes of one checkpoint
are spread at the rate the disk absorbs them instead of bursting (dirty pages, a queue of requests the step's
own page faults and reads wait behind). Until one write has been measured nothing is paced.
"""
from __future__ import annotations

import threading
import time

__all__ = ["WritePacer"]


class WritePacer:
    """A token bucket for the I/O workers, refilled at the measured write bandwidth."""

    def __init__(self, burst_bytes: int, weight: float = 0.3) -> None:
        self._burst = float(burst_bytes)  # at most one shard may go at once: the bucket's depth
        self._weight = weight
        self._rate: float | None = None  # bytes per second; None until measured
        self._tokens = float(burst_bytes)
        self._stamp = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.waited_s = 0.0  # total time workers slept for tokens (figures, tests)

    @property
    def rate(self) -> float | None:
        """The measured sustained write bandwidth, bytes per second (None until a write was measured)."""
        return self._rate

    def take(self, nbytes: int) -> None:
        """Called by an I/O worker before it writes ``nbytes``: returns once the bucket holds them (at once until
        a rate is known, or after ``close()``)."""
        need = float(min(nbytes, self._burst))  # a shard larger than the bucket waits for a full bucket
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                if self._rate is None:
                    return
                self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
                self._stamp = now
                if self._tokens >= need:
                    self._tokens -= need
                    return
                short = (need - self._tokens) / self._rate
            t0 = time.monotonic()
            self._stop.wait(short)  # woken early only by close(): nothing else adds tokens
            self.waited_s += time.monotonic() - t0

    def measured(self, nbytes: int, seconds: float) -> None:
        """Called by an I/O worker after a write of ``nbytes`` that took ``seconds``: update the rate."""
        if seconds <= 0 or nbytes <= 0:
            return
        bw = nbytes / seconds
        with self._lock:
            self._rate = bw if self._rate is None else (1 - self._weight) * self._rate + self._weight * bw

    def close(self) -> None:
        """Release every waiting worker for good (the pipeline is closing)."""
        self._stop.set()
