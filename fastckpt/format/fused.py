"""The fused pass: a staged shard's copy, CRC32C and health statistics in one compiled call that holds no GIL
(``staging.compiled_pass``; the kernel: format/fusedkernels.py).

Why. A launch-bound training thread (a GPU job's Python thread) waits each time a background thread takes the GIL
back. The batched pass (format/batchpass.py) costs a handful of torch calls per 8 MiB piece: the copy thread took
the GIL back 1,626 times per W1 checkpoint (1.48 GB, 580 tensors; ``python -m benchmarks.gilcalls``), 616 of them
for the reductions, and the quiet host's stall was that count times tens of microseconds
(``python -m benchmarks.stallwhere``). Here a shard is one call whatever its tensors, and the reductions are the
integer max of the magnitudes' bits plus a float64 sum of squares, both vectorized: about 0.03 CPU-s per GB on top of
the copy and the CRC32C, where the torch reductions took about 0.2.

What it covers. Shards of the open layout (CRC32C per tensor) whose tensors are float32, float64 or bfloat16 at
their alignment (measured in the kernel), or any other dtype up to ``SMALL`` bytes (copied and checksummed there,
measured value for value after it by format/healthpass.py's blocked pass); with a copy, every source a plain CPU
tensor of the staged view's dtype and shape. Anything else takes the batched pass, as before. The statistics are
format/health.py's: ``absmax`` exactly (the largest magnitude), ``l2`` from a float64 sum of squares (within 1e-6
relative of the float32 group norms the other passes sum), ``fp`` by the same function; a tensor whose bits show a
NaN or an Inf, or whose squares overflow, is measured value for value by the blocked pass (its counts exact).

How it gets compiled, without a stall. numba compiles the kernel in seconds, holding the GIL, and loads it from its
on-disk cache in a third of a second. So the warm-up (one per process, on the ``fastckpt-jit`` thread) first
compiles it in a child process at low priority (filling the cache), then imports it here (a cache hit: the one GIL
hold left, once per process). It starts at the first save of at least ``MIN_BYTES`` bytes (``auto``: smaller
states gain nothing worth a child process), at ``Checkpointer`` construction (``on``), or at ``prewarm()``; until it
is done, shards take the batched pass. A warm-up that fails (numba missing, a compiler error, a kernel whose
results disagree with the self-test) leaves the batched pass in place, said once (a ``RuntimeWarning``; ``auto``
without numba installed says nothing). A damaged entry of the cache next to the module (numba raises on it instead
of compiling again) is removed by the child, which then compiles afresh. numba's cache holds pickled code: it is
trusted as the package's own files are (the same folder, or numba's user-wide cache).
"""
from __future__ import annotations

import ctypes
import importlib
import importlib.util
import math
import os
import struct
import subprocess
import sys
import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import batchpass

__all__ = ["CHUNK", "MIN_BYTES", "SMALL", "Kernel", "kernel", "run", "state", "warm"]

MIN_BYTES = 64 << 20  # ``auto``: a state smaller than this never starts the warm-up
SMALL = 64 << 10  # a tensor of another dtype up to this size is measured after the kernel; a larger one: batched
CHUNK = 256 << 10  # bytes copied, checksummed and reduced in turn: in a core's L2 between the three
_KINDS = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2}
_BYTES = 3
# a magnitude's bits at or above these hold a NaN or an Inf (per kind)
_NONFINITE = {0: 0x7F800000, 1: 0x7FF0000000000000, 2: 0x7F80}
_CHILD_TIMEOUT_S = 600.0

# The child compiles the kernel module under its package name (numba's cache records it) without importing the
# package itself (torch): empty parent packages pointing at the source folders.
_CHILD = """
import os, sys, types
os.nice(10)
root = sys.argv[1]
for name, path in (("fastckpt", root), ("fastckpt.format", os.path.join(root, "format"))):
    module = types.ModuleType(name)
    module.__path__ = [path]
    sys.modules[name] = module
try:
    import fastckpt.format.fusedkernels
except Exception:  # a damaged cache entry: numba refuses it rather than compiling again; removed, compiled afresh
    cache = os.path.join(root, "format", "__pycache__")
    for name in os.listdir(cache) if os.path.isdir(cache) else ():
        if name.startswith("fusedkernels.") and name.endswith((".nbi", ".nbc")):
            os.remove(os.path.join(cache, name))
    sys.modules.pop("fastckpt.format.fusedkernels", None)
    import fastckpt.format.fusedkernels
"""


class Kernel:
    """The compiled kernel, with the C functions it checksums through: ``sums[name] = (address, flip)``."""

    def __init__(self, fn: Any, sums: dict[str, tuple[int, int]]) -> None:
        self.fn = fn
        self.sums = sums
        self._local = threading.local()

    def scratch(self) -> np.ndarray:
        """This thread's widening scratch (bfloat16 values become float32 there)."""
        s = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = np.empty(CHUNK // 2, dtype=np.uint32)
        return s


def _checksums() -> dict[str, tuple[int, int]]:
    """The C functions the kernel checksums through, each checked against fastckpt's own checksum: ``crc32c``, the
    crc32c package's (``uint32_t f(uint32_t crc, const void *p, size_t n)``, its running value the inverted
    register: flip 0xFFFFFFFF) and, where zlib-ng is installed, ``crc32``, its ``zng_crc32`` (zlib's convention:
    flip 0)."""
    import crc32c
    import crc32c._crc32c as ext

    from .checksum import crc32 as zip_crc32
    from .checksum import crc32c as fast_crc32c

    probe = bytes(range(256)) * 3
    found: dict[str, tuple[int, int]] = {}
    lib = ctypes.CDLL(ext.__file__)
    fn = getattr(lib, "_crc32c_hw_adler" if getattr(crc32c, "hardware_based", False) else "_crc32c_sw_slicing_by_8")
    fn.argtypes, fn.restype = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_uint32
    if fn(0xFFFFFFFF, probe, len(probe)) ^ 0xFFFFFFFF != fast_crc32c(probe):
        raise RuntimeError("the crc32c package's C function does not compute CRC32C as expected")
    found["crc32c"] = (int(ctypes.cast(fn, ctypes.c_void_p).value or 0), 0xFFFFFFFF)
    try:
        import zlib_ng.zlib_ng as zng

        zfn = ctypes.CDLL(zng.__file__).zng_crc32
    except (ImportError, OSError, AttributeError):
        return found  # a torch file's records take the batched pass
    zfn.argtypes, zfn.restype = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_uint32
    if zfn(0, probe, len(probe)) == zip_crc32(probe):
        found["crc32"] = (int(ctypes.cast(zfn, ctypes.c_void_p).value or 0), 0)
    return found


class _Loader:
    """The process's one warm-up: cold -> warming -> ready | failed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.state = "cold"
        self.reason = ""
        self.kernel: Kernel | None = None
        self.done: Future = Future()

    def get(self, start: bool, loud: bool) -> Kernel | None:
        """The kernel when ready, else None; ``start``: begin the warm-up if it has not begun."""
        if self.state == "ready":
            return self.kernel
        if start and self.state == "cold":
            self.warm(loud)
        return None

    def warm(self, loud: bool) -> Future:
        """Begin the warm-up (once per process); the Future gives the kernel, or None where it failed."""
        with self._lock:
            if self.state == "cold":
                self.state = "warming"
                threading.Thread(target=self._run, args=(loud,), name="fastckpt-jit", daemon=True).start()
            return self.done

    def _run(self, loud: bool) -> None:
        try:
            if importlib.util.find_spec("numba") is None:
                raise ModuleNotFoundError("numba is not installed (pip install numba)")
            sums = _checksums()
            root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            child = subprocess.run([sys.executable, "-c", _CHILD, root], capture_output=True, text=True,
                                   timeout=_CHILD_TIMEOUT_S, stdin=subprocess.DEVNULL)
            if child.returncode != 0:
                raise RuntimeError(f"compiling the kernel failed (exit code {child.returncode}): "
                                   f"{child.stderr.strip()[-600:]}")
            module = importlib.import_module("fastckpt.format.fusedkernels")  # numba's cache: no compile here
            got = Kernel(module.shard_pass, sums)
            _self_test(got)
        except BaseException as e:  # noqa: BLE001 - the batched pass stays; said once
            self.reason = f"{type(e).__name__}: {e}"
            self.state = "failed"
            if loud or not isinstance(e, ModuleNotFoundError):
                warnings.warn(f"fastckpt: the compiled pass is not used ({self.reason}); checkpoints take the "
                              "batched pass, which costs a launch-bound training thread more "
                              "(staging.compiled_pass: off silences this)", RuntimeWarning, stacklevel=1)
            self.done.set_result(None)
            return
        self.kernel = got
        self.state = "ready"
        self.done.set_result(got)

    def after_fork(self) -> None:
        """In a forked child: a warm-up in flight belongs to the parent's thread, gone here; a ready kernel stays."""
        self._lock = threading.Lock()
        if self.state == "warming":
            self.state = "cold"
            self.done = Future()


_LOADER = _Loader()
os.register_at_fork(after_in_child=_LOADER.after_fork)


def kernel(mode: str, nbytes: int) -> Kernel | None:
    """The compiled kernel where ``mode`` (``staging.compiled_pass``) allows it and it is ready; a save of
    ``nbytes`` bytes of state starts the warm-up under ``auto`` from ``MIN_BYTES``, and always under ``on``."""
    if mode == "off":
        return None
    return _LOADER.get(start=mode == "on" or nbytes >= MIN_BYTES, loud=mode == "on")


def warm(mode: str) -> Future:
    """Begin the warm-up now (``Checkpointer`` construction under ``on``, ``prewarm()``); the Future gives the
    kernel, or None (``off``, or the warm-up failed)."""
    if mode == "off":
        done: Future = Future()
        done.set_result(None)
        return done
    return _LOADER.warm(loud=mode == "on")


def state() -> tuple[str, str]:
    """The warm-up's state (cold, warming, ready, failed) and, once failed, why."""
    return _LOADER.state, _LOADER.reason


@dataclass(slots=True)
class _Plan:
    """What the kernel needs of a layout, made once: each entry's kind, staged address and size."""

    kinds: np.ndarray
    plain: np.ndarray  # every kind 3 (no statistics wanted)
    dsts: np.ndarray
    ns: np.ndarray


def _plan(lay: Any) -> _Plan | None:
    kinds = []
    base, size = lay.buf.data_ptr(), lay.buf.numel() * lay.buf.element_size()
    for e, dt in zip(lay.entries, lay.dtypes):
        if e.offset < 0 or e.nbytes < 0 or e.offset + e.nbytes > size:  # the kernel writes by address: never past
            return None  # the buffer (the batched pass's views would name the mismatch)
        kind = _KINDS.get(dt)
        if kind is not None and e.nbytes and e.offset % dt.itemsize == 0 and e.nbytes % dt.itemsize == 0:
            kinds.append(kind)
        elif e.nbytes <= SMALL:
            kinds.append(_BYTES)
        else:
            return None
    n = len(kinds)
    return _Plan(kinds=np.array(kinds, dtype=np.int8), plain=np.full(n, _BYTES, dtype=np.int8),
                 dsts=np.array([base + e.offset for e in lay.entries], dtype=np.int64),
                 ns=np.array([e.nbytes for e in lay.entries], dtype=np.int64))


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is a contiguous CPU tensor holding exactly its values (no lazy conjugate/negative bit). Each
    of ``is_conj``/``is_neg`` hands the GIL over: the copy thread passes engine/onepass.py's, which reads the
    dispatch keys instead."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _sources(lay: Any, tensors: Sequence[torch.Tensor | None],
             plain: Callable[[torch.Tensor], bool]) -> tuple[np.ndarray, list[Any]] | None:
    """Each entry's source address and the storages that hold them (kept for the call: a tensor whose ``.data``
    is swapped meanwhile must not free what the kernel reads), or None where one is not a plain CPU tensor of its
    staged view's dtype and shape (the batched pass copies those, or names the mismatch)."""
    out = np.zeros(len(lay.entries), dtype=np.int64)
    keep = []
    for pos, (e, view) in enumerate(zip(lay.entries, lay.views)):
        if e.nbytes == 0:
            continue
        src = tensors[e.index]
        if src is None or src.dtype != view.dtype or src.shape != view.shape or not plain(src):
            return None
        storage = src.untyped_storage()  # first: the address below is of this storage, whatever happens to src
        at = src.storage_offset() * src.element_size()
        if at + e.nbytes > storage.nbytes():
            return None
        keep.append(storage)
        out[pos] = storage.data_ptr() + at
    return out, keep


def run(k: Kernel, lay: Any, *, tensors: Sequence[torch.Tensor | None] | None, health: bool,
        plain: Callable[[torch.Tensor], bool] = _plain,
        checksum: str = "crc32c") -> tuple[list[int], dict[int, dict[str, Any]]] | None:
    """One compiled call over the shard of ``lay`` (format/batchpass.py's ``Layout``): copy each entry from
    ``tensors`` (where given), then each entry's ``checksum`` (``crc32c``, or a torch file's zip ``crc32``; in
    ``lay.entries`` order) and, with ``health``, its statistics by position, as ``batchpass.run`` returns them
    (``plain``: whether a source may be read as its bytes). None where the shard is not covered (see the module
    docstring): the caller takes the batched pass."""
    plan = lay.fused
    if plan is None:
        plan = lay.fused = _plan(lay) or False
    if plan is False or checksum not in k.sums:
        return None
    got = (plan.dsts, None) if tensors is None else _sources(lay, tensors, plain)
    if got is None:
        return None
    srcs, keep = got
    n = len(lay.entries)
    crcs = np.zeros(n, dtype=np.uint32)
    tops = np.zeros(n, dtype=np.uint64)
    sqs = np.zeros(n, dtype=np.float64)
    kinds = plan.kinds if health else plan.plain
    fn, flip = k.sums[checksum]
    k.fn(kinds, srcs, plan.dsts, plan.ns, fn, flip, CHUNK, tensors is not None, crcs, tops, sqs, k.scratch())
    del keep  # the sources' storages, held through the call
    return crcs.tolist(), (_stats(lay, kinds, tops.tolist(), sqs.tolist()) if health else {})


def _magnitude(kind: int, top: int) -> float:
    """The largest magnitude from its bits, in the kind's width."""
    if kind == 0:
        return struct.unpack("<f", struct.pack("<I", top))[0]
    if kind == 1:
        return struct.unpack("<d", struct.pack("<Q", top))[0]
    return struct.unpack("<f", struct.pack("<I", top << 16))[0]


def _stats(lay: Any, kinds: np.ndarray, tops: list[int], sqs: list[float]) -> dict[int, dict[str, Any]]:
    """The entries the kernel measured and found finite, the others value for value (``batchpass.records``)."""
    found = {pos: (_magnitude(kind, top), sq) for pos, (kind, top, sq) in enumerate(zip(kinds.tolist(), tops, sqs))
             if kind != _BYTES and top < _NONFINITE[kind] and math.isfinite(sq)}
    return batchpass.records(lay, memoryview(lay.buf.numpy()), found)


def _self_test(k: Kernel) -> None:
    """The kernel against fastckpt's checksums and torch's reductions, over each kind, before it is trusted."""
    from .checksum import crc32, crc32c

    want_sum = {"crc32c": crc32c, "crc32": crc32}

    g = torch.Generator().manual_seed(0)
    values = {torch.float32: torch.randn(70001, generator=g), torch.float64: torch.randn(9001, generator=g,
                                                                                            dtype=torch.float64),
              torch.bfloat16: torch.randn(30001, generator=g).bfloat16()}
    for dtype, src in values.items():
        raw = src.view(torch.uint8)
        dst = torch.empty_like(raw)
        kinds = np.array([_KINDS[dtype]], dtype=np.int8)
        want = float(src.double().abs().max())
        l2 = float(src.double().square().sum().sqrt())
        for name, (fn, flip) in k.sums.items():
            crcs, tops, sqs = np.zeros(1, np.uint32), np.zeros(1, np.uint64), np.zeros(1, np.float64)
            dst.zero_()
            k.fn(kinds, np.array([raw.data_ptr()], np.int64), np.array([dst.data_ptr()], np.int64),
                 np.array([raw.numel()], np.int64), fn, flip, 4096, True, crcs, tops, sqs, k.scratch())
            if (not torch.equal(dst, raw) or int(crcs[0]) != want_sum[name](raw.numpy())
                    or _magnitude(int(kinds[0]), int(tops[0])) != want or abs(math.sqrt(sqs[0]) - l2) > 1e-9 * l2):
                raise RuntimeError(f"the compiled kernel's self-test failed for {dtype} ({name})")
