"""torch's own CUDA runtime, for the calls torch's bindings lack, and the CUDA streams only fastckpt uses.

Below both the engine (a save's device-to-host copies, engine/streams.py, and its page-locked buffers,
engine/pinned.py) and read/ (a load's host-to-device copies, read/devicecopy.py): the two siblings copy through
streams of the same kind, made here.

**Which runtime.** A process may hold several ``libcudart`` (cupy, TensorRT, a framework's own copy beside torch's).
Each keeps its own state (the last error of each thread, its current device), so a call through another one than
torch's clears or reads nothing torch sees: a ``cudaGetLastError`` meant to drop a failed registration's error would
leave it for torch's next kernel launch check to raise, naming an innocent kernel. ``loaded_cudart`` therefore asks
torch's own CUDA library (``libc10_cuda.so``, else ``libtorch_cuda.so``) which file it takes ``cudaGetLastError``
from: ``dlsym`` through that library's handle searches it and its dependencies as the dynamic linker bound them,
and ``dladdr`` names the file the symbol lies in. Where that file is no loaded ``libcudart`` (torch links the runtime
statically) there is none to call; where the question cannot be asked (no torch CUDA library loaded, no ``dladdr``)
a lone loaded ``libcudart`` is used, several are not (the first by path was as likely cupy's as torch's).

**Dedicated streams.** ``torch.cuda.Stream()`` hands out the same 32 streams per priority and device to every
caller, NCCL's and FSDP2's side streams included, so a copy on one could queue behind (or delay) a collective.
``dedicated_stream`` makes a new non-blocking stream through torch's runtime (``cudaStreamCreateWithPriority``,
wrapped in ``torch.cuda.ExternalStream``); callers keep theirs for the life of the process (torch's caching
allocator keeps using a stream after its user is gone, and a destroyed stream is a CUDA error there). Without a
runtime to call, a pool stream serves, logged once.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from typing import Any, Iterator

import torch

from .errors import FastCkptError

__all__ = ["clear_last_cuda_error", "dedicated_stream", "loaded_cudart", "mapped_libraries", "pick_runtime",
           "symbol_file", "torch_library"]

log = logging.getLogger("fastckpt")

_TORCH_CUDA_LIBS = ("libc10_cuda.so", "libtorch_cuda.so")  # torch's own CUDA libraries, asked in this order
_NON_BLOCKING = 1  # cudaStreamNonBlocking: no implicit wait on the legacy default stream (as torch's pool streams)
_fallback_logged = False
_found: list[Any] = []  # torch's runtime once found: it stays loaded (and torch's) for the life of the process
_found_lock = threading.Lock()


def mapped_libraries() -> list[str]:
    """The files this process has mapped (``/proc/self/maps``), canonical paths, in map order; [] where unknown."""
    try:
        with open("/proc/self/maps") as f:
            fields = [line.split(None, 5) for line in f]
    except OSError:
        return []
    seen = dict.fromkeys(f[5].strip() for f in fields if len(f) == 6)  # the sixth field: the file, when one
    return [p for p in seen if p.startswith("/")]


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def symbol_file(owner: str, symbol: str) -> str | None:
    """The file (canonical path) that defines ``symbol`` as the loaded library ``owner`` resolves it: ``dlsym``
    through ``owner``'s own handle (the library, then its dependencies as they were bound), then ``dladdr``. None
    where ``owner`` is not loaded, does not reach ``symbol``, or the C library offers no ``dladdr``."""
    try:
        lib = ctypes.CDLL(owner, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # the loaded one, never a new load
        address = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
        libc = ctypes.CDLL(None)
        dladdr = getattr(libc, "dladdr", None) or ctypes.CDLL("libdl.so.2").dladdr
    except (OSError, AttributeError):
        return None
    info = _DlInfo()
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not address or not dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(os.fsdecode(info.dli_fname))


def pick_runtime(candidates: list[str], own: str | None, asked: bool) -> str | None:
    """Which of the loaded ``candidates`` to call: torch's ``own`` when ``asked`` found it (None if that is none of
    them: a statically linked runtime); unasked, the only candidate, never one of several."""
    if asked:
        return own if own in candidates else None
    return candidates[0] if len(candidates) == 1 else None


def torch_library(fragment: str, owners: tuple[str, ...], symbol: str) -> str | None:
    """Of the loaded libraries whose file name holds ``fragment``, the one torch's library ``owners`` (file names,
    the first loaded one asked) take ``symbol`` from (``pick_runtime``)."""
    return _torch_library(fragment, owners, symbol)[0]


def _torch_library(fragment: str, owners: tuple[str, ...], symbol: str) -> tuple[str | None, bool]:
    """``torch_library``'s answer, and whether torch's own library answered it (then it holds for the process)."""
    mapped = mapped_libraries()
    candidates = sorted({p for p in mapped if fragment in os.path.basename(p)})
    if not candidates:
        return None, False
    own, asked = None, False
    for name in owners:
        owner = next((p for p in mapped if os.path.basename(p) == name), None)
        if owner is not None:
            own = symbol_file(owner, symbol)
            asked = own is not None
            break
    return pick_runtime(candidates, own, asked), asked


def loaded_cudart() -> Any:
    """torch's own CUDA runtime library (``ctypes.CDLL``, the instance torch calls: same error state, same current
    device), or None where there is none to call (a CPU-only build, a statically linked runtime, or several loaded
    and torch's own unknown). Kept once torch's own library named it: that answer cannot change."""
    if _found:
        return _found[0]
    path, asked = _torch_library("libcudart", _TORCH_CUDA_LIBS, "cudaGetLastError")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same library instance
    except OSError:
        return None
    if asked:
        with _found_lock:
            if not _found:
                _found.append(lib)
    return lib


def clear_last_cuda_error() -> None:
    """Reset torch's CUDA runtime's last error of this thread (``cudaGetLastError``), which torch's bindings do not
    expose. Nothing to do where there is no runtime to call (``loaded_cudart``)."""
    lib = loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


def dedicated_stream(device: int, priority: int) -> Any:
    """A new non-blocking stream of ``device`` only fastckpt uses, ``priority`` clamped to the device's range; or a
    pool stream where there is no runtime to call (``loaded_cudart``). The caller keeps it for the whole process."""
    lib = loaded_cudart()
    if lib is None:
        global _fallback_logged
        if not _fallback_logged:
            _fallback_logged = True
            log.debug("fastckpt: torch's CUDA runtime library cannot be called here (linked statically, or beside "
                      "another libcudart): the copies use torch's pool streams, which NCCL and FSDP may share")
        return torch.cuda.Stream(device=device, priority=priority)
    handle = ctypes.c_void_p()
    with _on_device(lib, device):
        least, greatest = ctypes.c_int(), ctypes.c_int()
        _check(lib, lib.cudaDeviceGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
               "cudaDeviceGetStreamPriorityRange", device)
        prio = min(max(priority, greatest.value), least.value)  # lower is higher; greatest <= least
        _check(lib, lib.cudaStreamCreateWithPriority(ctypes.byref(handle), ctypes.c_uint(_NON_BLOCKING),
                                                      ctypes.c_int(prio)), "cudaStreamCreateWithPriority", device)
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", device))


@contextlib.contextmanager
def _on_device(lib: Any, device: int) -> Iterator[None]:
    """``device`` current for torch and for ``lib`` (torch's runtime: set on both anyway, and ``lib``'s own current
    device restored after)."""
    prev = ctypes.c_int(-1)
    with torch.cuda.device(device):
        if lib.cudaGetDevice(ctypes.byref(prev)) != 0:
            prev.value = -1
        lib.cudaSetDevice(ctypes.c_int(device))
        try:
            yield
        finally:
            if prev.value >= 0:
                lib.cudaSetDevice(prev)


def _check(lib: Any, err: int, call: str, device: int) -> None:
    if err != 0:
        lib.cudaGetLastError()  # reported here: the next kernel launch check must not raise it again
        raise FastCkptError(f"{call} failed on cuda:{device} (CUDA error {err}) while creating a fastckpt copy "
                            "stream; check the device (nvidia-smi) and the CUDA installation")
