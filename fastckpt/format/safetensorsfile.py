"""One plain safetensors file (``model.safetensors``), as data: a JSON header plus one byte range per tensor.

The header is what ``safetensors.torch.save_file(state, path, metadata)`` writes: an 8-byte length, the JSON
(``__metadata__`` plus each tensor's dtype, shape and ``data_offsets``) padded with spaces to a multiple of 8,
then the tensors back to back. The format decides the header and offsets; the engine stages each tensor's
bytes and writes them at their offset, exactly as for a torch file (``torchfile.TorchFileFormat``).
``st_dtype`` is safetensors' name of a torch dtype, also used by the core layout's shard headers.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SafetensorsFileFormat", "st_dtype"]

_ALIGN = 8  # safetensors pads its header so that every tensor starts 8-byte aligned

# safetensors dtype names; dtypes safetensors cannot name are stored as raw U8 bytes
# with the real dtype kept in fastckpt's metadata, so plain readers still see bytes.
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}


def st_dtype(dtype: torch.dtype) -> str:
    """The safetensors dtype string for ``dtype`` (``U8`` when safetensors has none)."""
    return _ST_DTYPES.get(dtype, "U8")


@dataclass(eq=False)
class SafetensorsFileFormat:
    """How the pipeline writes one ``.safetensors`` file: table entry ``i`` of the save's plan is tensor ``i``."""

    header: bytes
    offsets: list[int]  # absolute offset of each tensor in the file
    size: int
    path: str

    @classmethod
    def plan(cls, state: dict[str, torch.Tensor], path: str,
             metadata: dict[str, str] | None = None) -> tuple["SafetensorsFileFormat", list[torch.Tensor], list[str]]:
        """The format, the tensors to stage (in file order) and their keys. Raises ``ValueError`` as
        ``safetensors.torch.save_file`` does: on a non-tensor value, or on tensors sharing memory."""
        names = sorted(state, key=lambda k: (-_itemsize(state[k]), k))  # safetensors' own order: by alignment
        _check(state, names)
        tensors = [state[k].contiguous() for k in names]  # the same tensor when already contiguous (lazy-able)
        entries: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        start = 0
        for key, t in zip(names, tensors):
            nbytes = t.numel() * t.element_size()
            if st_dtype(t.dtype) == "U8" and t.dtype != torch.uint8:
                raise ValueError(f"tensor {key!r}: safetensors has no dtype for {t.dtype}")
            entries[key] = {"dtype": st_dtype(t.dtype), "shape": list(t.shape), "data_offsets": [start, start + nbytes]}
            start += nbytes
        body = json.dumps(entries, separators=(",", ":")).encode()
        body += b" " * (-len(body) % _ALIGN)
        header = struct.pack("<Q", len(body)) + body
        offsets = [len(header) + e["data_offsets"][0] for e in (entries[k] for k in names)]
        return cls(header, offsets, len(header) + start, path), tensors, names

    def checksum(self, data: memoryview, entries: Any) -> dict[int, int]:
        """Nothing to fill in (the header holds no checksum); the bundle's manifest checksums the whole file."""
        return {e.index: 0 for e in entries}

    def parts(self, views: dict[int, memoryview], crcs: dict[int, int]) -> list[memoryview]:
        """The whole file as buffers: the header, then every tensor in order."""
        return [memoryview(self.header)] + [v for v in (views.get(i) for i in range(len(self.offsets))) if v is not None and len(v)]


def _itemsize(value: Any) -> int:
    return value.element_size() if isinstance(value, torch.Tensor) else 0


def _check(state: dict[str, Any], names: list[str]) -> None:
    spans: list[tuple[int, int, str]] = []
    for key in names:
        t = state[key]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"key {key!r}: safetensors stores tensors only, got {type(t).__name__}")
        if t.layout is not torch.strided or t.device.type == "meta":
            raise ValueError(f"tensor {key!r}: safetensors cannot store a {t.layout} tensor on {t.device}")
        if t.numel():
            start = t.data_ptr()
            spans.append((start, start + t.numel() * t.element_size(), key))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:  # safetensors refuses shared memory; Accelerate drops the duplicates before saving
            raise ValueError(f"tensors {a!r} and {b!r} share memory; safetensors stores each tensor once: remove "
                             "one of them (tied weights) before saving")
