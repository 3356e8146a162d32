"""How much of a local file sits in the page cache: the choice between mapping a shard and reading it.

A shard whose pages are cached is best mapped (``LocalStorage.map_file``): the tensors view the page
cache and nothing is copied (a warm 1.48 GB ``load()`` takes ~0.08 s). A shard that is not cached is
best read with O_DIRECT on many threads into fresh memory (``fastckpt.read.readers``): mapping it makes
the load wait on readahead of one stream and leaves tensors that copy every 4 KiB page the first time
training writes them (copy-on-write of a file mapping). ``resident_fraction`` asks the kernel
(``mincore(2)`` over a throwaway mapping: no page is read), so the choice costs microseconds.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import numpy as np

__all__ = ["resident_fraction"]

_PAGE = mmap.PAGESIZE


def _libc_mincore() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.mincore
    except (OSError, AttributeError):  # not Linux/BSD: callers treat every file as cached (map it)
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_MINCORE = _libc_mincore()


def resident_fraction(path: str, size: int) -> float:
    """The fraction (0.0-1.0) of the first ``size`` bytes of ``path`` that are in the page cache.

    1.0 where it cannot be told (no ``mincore``, an unmappable file): mapping, the old behaviour, stays
    the answer there. Reads nothing from the file.
    """
    if _MINCORE is None or size <= 0:
        return 1.0
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return 1.0
    try:
        pages = (size + _PAGE - 1) // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        view = np.frombuffer(mm, dtype=np.uint8)  # numpy takes the address of a read-only mapping; ctypes won't
        try:
            failed = _MINCORE(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)  # type: ignore[operator]
        finally:
            del view  # the export must end before the mapping closes
        if failed:
            return 1.0
        return int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1)) / pages  # bit 0: resident
    finally:
        mm.close()
