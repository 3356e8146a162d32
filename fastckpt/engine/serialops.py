"""Serial torch reductions on the calling thread only: ``serial_here()``, called once by each background thread.

The batched pass (format/batchpass.py) measures megabytes per torch call, so that the background takes the GIL a
few hundred times a checkpoint instead of tens of thousands: the training thread that launches the kernels pays for
each time it must hand the GIL over. But a reduction over more than torch's grain size fans out over every core of
torch's intra-op pool, the training thread's core included. ``torch.set_num_threads`` is no answer: it also moves a
process-wide counter that threads started later (autograd's device threads) copy. With torch's OpenMP backend the
pool's width is an OpenMP per-thread setting (``nthreads-var``), read by ``at::get_num_threads()`` on the calling
thread; so this thread calls ``omp_set_num_threads(1)`` of the OpenMP runtime torch loaded, after torch's own lazy
per-thread initialisation has run (it would reset it otherwise), and every torch reduction it makes then runs inline.
Other threads keep their width. Where that runtime cannot be found (another parallel backend), ``serial_here()``
says so and the caller keeps the small-block pass, whose reductions never exceed the grain size.
"""
from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["serial_here", "is_serial"]

_RUNTIMES = ("libgomp", "libiomp", "libomp")


@functools.lru_cache(maxsize=1)
def _omp_set_num_threads() -> object | None:
    """``omp_set_num_threads`` of the OpenMP runtime loaded in this process (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line and any(r in line for r in _RUNTIMES)}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = None
        return fn
    return None


def serial_here() -> bool:
    """Make every torch reduction of the calling thread run on this thread alone; True once it does."""
    if torch.get_num_threads() == 1:  # also runs torch's lazy per-thread init, which would undo the call below
        return True
    fn = _omp_set_num_threads()
    if fn is None:
        return False
    fn(1)  # type: ignore[operator]
    return torch.get_num_threads() == 1


def is_serial() -> bool:
    """Whether the calling thread's torch reductions run inline (``serial_here`` took, or torch has one thread)."""
    return torch.get_num_threads() == 1

