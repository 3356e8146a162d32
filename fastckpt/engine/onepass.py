"""One pass over the bytes: the copy into the staging buffer and its CRC32C together (``staging.crc_in_copy``).

Without it the copy thread moves the state into the slot (one read, one write of every byte) and the I/O workers
read it all again for the CRC32C the shard files record. With it the copy thread copies a shard's tensors chunk by
chunk and checksums each chunk of the *staged* copy right after copying it, while the chunk is still in cache, and
hands the CRCs to the writer (``Job.staged_crcs``), which then reads the bytes only to write them.

Both calls release the GIL (``ctypes.memmove``; ``crc32c`` on buffers over 32 KiB), so the training thread is not
held behind them. Only plain CPU sources take this path: a CUDA source lands by DMA, later, and its CRC is taken
once it has (the writer or the shared-memory check); any other layout goes through ``copy_entries``.

The CRC is of the destination, never of the source: a source written during its copy (caught later by the
mutation guard and the seal) must not leave a file whose recorded CRC differs from its bytes.
"""
from __future__ import annotations

import ctypes
from typing import Iterable

import torch

from ..format.checksum import crc32c
from ..format.plan import TensorEntry
from .staging import copy_entries

__all__ = ["CHUNK", "copy_with_crcs", "plain_sources"]

# Small enough to stay in a core's L2 (4 MiB here) between the copy and the checksum, large enough that the two
# calls per chunk cost nothing next to the bytes.
CHUNK = 1 << 20


def plain_sources(entries: Iterable[TensorEntry], tensors: list[torch.Tensor | None]) -> bool:
    """Whether every non-empty entry's source is a contiguous CPU tensor holding exactly its values."""
    for e in entries:
        if e.nbytes == 0:
            continue
        t = tensors[e.index]
        if t is None or t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return False
    return True


def copy_with_crcs(buf: torch.Tensor, entries: Iterable[TensorEntry],
                   tensors: list[torch.Tensor | None]) -> dict[int, int]:
    """Copy each entry's (plain CPU) source into ``buf`` and return the CRC32C of each entry's staged bytes by
    entry index. ``entries`` may be the mutation guard's checking iterator: each entry is fully copied before the
    next is asked for."""
    view = memoryview(buf.numpy())
    base = buf.data_ptr()
    out: dict[int, int] = {}
    for e in entries:
        if e.nbytes == 0:
            out[e.index] = crc32c(b"")
            continue
        src = tensors[e.index].detach()  # type: ignore[union-attr]
        if e.offset + e.nbytes > buf.numel() or src.numel() * src.element_size() != e.nbytes:
            raise ValueError(f"staging layout mismatch for tensor #{e.index}: the state changed shape "
                             "while it was being saved")
        if not (src.device.type == "cpu" and src.is_contiguous() and not src.is_conj() and not src.is_neg()):
            copy_entries(buf, [e], tensors)  # the caller checked: only a race on the state's layout gets here
            out[e.index] = crc32c(view[e.offset: e.offset + e.nbytes])
            continue
        crc = 0
        sp = src.data_ptr()
        for o in range(0, e.nbytes, CHUNK):
            k = min(CHUNK, e.nbytes - o)
            ctypes.memmove(base + e.offset + o, sp + o, k)
            crc = crc32c(view[e.offset + o: e.offset + o + k], crc)
        out[e.index] = crc
    return out
