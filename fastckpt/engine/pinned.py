"""Page-locked host memory for CUDA copies: ``Pinned`` (``cudaHostRegister`` of an exact-size mapping).

The CUDA runtime calls torch's bindings lack (``loaded_cudart``, ``clear_last_cuda_error``) are fastckpt/cudart.py's,
re-exported here for the engine.

Not ``torch.empty(pin_memory=True)``: the caching host allocator rounds every buffer up to a power of two and keeps
it after close. ``engine/staging.py`` decides when a buffer is made (``Slot.buffer``); this module only makes it.
"""
from __future__ import annotations

import contextlib
import mmap
import os

import torch

from ..cudart import clear_last_cuda_error, loaded_cudart
from ..errors import FastCkptError

__all__ = ["Pinned", "clear_last_cuda_error", "fs_type", "host_buffer", "loaded_cudart"]


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device's context, not only the current one


class Pinned:
    """Keeps ``mm`` page-locked for CUDA (``cudaHostRegister``) until ``release()`` or collection."""

    def __init__(self, mm: mmap.mmap, buf: torch.Tensor, what: str, folder: str | None = None) -> None:
        self.mm = mm
        self._ptr = buf.data_ptr()
        self._pid = os.getpid()  # a fork()ed child inherits the mapping, not the registration nor a CUDA context
        # The device current at registration (save() selects the state's first device): the unregistration runs
        # under it too, so a close() or a collection on another thread opens no context on GPU 0.
        self._device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        err = int(torch.cuda.cudart().cudaHostRegister(self._ptr, len(mm), _HOST_REGISTER_PORTABLE))
        if err != 0:
            self._ptr = 0
            # The failed call left CUDA's last error set: the next kernel launch check would raise it, naming the
            # kernel instead of the registration. This error is reported here, so clear it.
            clear_last_cuda_error()
            fs = None if folder is None else fs_type(folder)
            if fs is not None and fs not in _PINNABLE_FS:
                # Measured on kernel 6.18 (H200 machine): a file mapping on tmpfs pins, one on ext4 fails with
                # error 1. Linux refuses long-term pins of writable pages of disk-backed files.
                raise FastCkptError(f"cannot page-lock {len(mm)} bytes of {what} for CUDA copies (cudaHostRegister "
                                    f"error {err}): that folder is on {fs}, and the kernel page-locks file-backed "
                                    "memory only on tmpfs; set staging.shm_dir to a tmpfs folder (/dev/shm)")
            raise FastCkptError(f"cannot page-lock {len(mm)} bytes of {what} for CUDA copies (cudaHostRegister "
                                f"error {err}); lower staging.max_host_bytes, or set staging.shm=false if it is on")

    def release(self) -> None:
        """Called when the arena drops the buffer: unlock it before it is unmapped."""
        ptr, self._ptr = self._ptr, 0
        if ptr and os.getpid() == self._pid:  # in a fork()ed child any CUDA call fails: the parent owns it
            with torch.cuda.device(self._device) if self._device is not None else contextlib.nullcontext():
                torch.cuda.cudart().cudaHostUnregister(ptr)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: the process frees it anyway
            pass


_PINNABLE_FS = {"tmpfs", "hugetlbfs", "ramfs"}  # memory-backed: cudaHostRegister accepts their file mappings


def fs_type(path: str) -> str | None:
    """The type of the file system holding ``path`` (its longest mount point in /proc/mounts), None if unknown."""
    path = os.path.realpath(path)
    best, kind = "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return None
    return kind


def host_buffer(nbytes: int, pin: bool) -> tuple[object, torch.Tensor]:
    """A page-aligned, exact-size anonymous buffer and what keeps it (its ``Pinned`` registration when ``pin``)."""
    # Page-aligned and zero-filled lazily by the kernel. No MADV_HUGEPAGE: with THP defrag
    # set to "madvise", first touches can stall in direct compaction.
    mm = mmap.mmap(-1, max(nbytes, 1))
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    return (Pinned(mm, buf, "host staging memory") if pin else mm), buf
