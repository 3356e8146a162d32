"""One safetensors file planned like a torch file, so that ``save_file`` (and ranks sharing its writes) take either.

``save_file(kind="safetensors")`` writes what ``safetensors.torch.save_file(state, path, {"format": "pt"})``
writes (``safetensorsfile.SafetensorsFileFormat``: its header, then the tensors back to back), through the torch
file's machinery: ``SafetensorsAsTorchFile`` is a ``TorchFileFormat`` whose layout has the header as its only
fixed bytes and one record per tensor (no CRC field to fill in). The shared-write protocols
(``engine/sharedfile.py``, ``engine/sharedobject.py``) and the pipeline then handle it unchanged: Accelerate's
``model.safetensors`` is uploaded by every rank as parts of one S3 object.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from .safetensorsfile import SafetensorsFileFormat
from .torchfile import TorchFileFormat, TorchFileLayout, TorchRecord

__all__ = ["KINDS", "SafetensorsAsTorchFile", "plan_file"]

KINDS = ("torch", "safetensors")


@dataclass(eq=False)
class SafetensorsAsTorchFile(TorchFileFormat):
    """A safetensors file as a ``TorchFileFormat``: record ``i`` is tensor ``i`` (in safetensors' order)."""

    dtypes: tuple[torch.dtype, ...] = ()
    # no zip directory to tie a health record to (healthrecord.content_tie): the inherited one would raise on rank 0
    # in the middle of a shared object's commit protocol and leave the other ranks waiting in a collective
    directory_digest = None

    @classmethod
    def plan_safetensors(cls, state: Any, path: str) -> tuple["SafetensorsAsTorchFile", list[torch.Tensor],
                                                                list[str], list[torch.Tensor]]:
        """The format, the tensors to stage, their keys, and the tensors the mutation guard watches (the same).
        Raises ``ValueError`` as ``safetensors.torch.save_file`` does (a non-tensor value, shared memory)."""
        if not isinstance(state, dict):
            raise TypeError(f"a safetensors file holds a dict of tensors, got {type(state).__name__}")
        st, tensors, keys = SafetensorsFileFormat.plan(state, path, metadata={"format": "pt"})
        records = tuple(TorchRecord(key=k, storage=None, offset=off, nbytes=t.numel() * t.element_size(),
                                    descriptor_crc=-1, central_crc=-1, dtype=str(t.dtype))
                        for k, off, t in zip(keys, st.offsets, tensors))
        layout = TorchFileLayout(size=st.size, segments=((0, st.header),), records=records)
        return cls(layout, path, dtypes=tuple(t.dtype for t in tensors)), tensors, keys, list(tensors)

    def value_dtype(self, entry: Any) -> torch.dtype:
        """The staged tensor's own dtype (its health statistics)."""
        return self.dtypes[entry.index]

    def checksum(self, data: memoryview, entries: Any) -> dict[int, int]:
        """No CRC field to fill in: the header holds none (a reader checks the whole file's CRC32C)."""
        return {e.index: 0 for e in entries}

    def fixed(self, crcs: dict[int, int]) -> list[tuple[int, bytearray]]:
        """The header at 0, then an empty gap after each tensor: the last entry (the tail) ends the file."""
        out = [(0, bytearray(self.layout.segments[0][1]))]
        out += [(r.offset + r.nbytes, bytearray()) for r in self.layout.records]
        return out


def plan_file(kind: str, state: Any, path: str) -> tuple[TorchFileFormat, list[torch.Tensor], list[str],
                                                          list[torch.Tensor]]:
    """``save_file``'s plan of ``state`` as a file of ``kind`` (``"torch"`` or ``"safetensors"``)."""
    if kind == "safetensors":
        return SafetensorsAsTorchFile.plan_safetensors(state, path)
    if kind != "torch":
        raise ConfigError(f"save_file(kind={kind!r}): the kind must be one of {', '.join(KINDS)}")
    return TorchFileFormat.plan(state, path)
