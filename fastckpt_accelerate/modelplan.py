"""Where each byte of a ``model.safetensors`` lands in a model: the plan of Accelerate's fast load into the
parameters (``fastload``), or why stock ``load_model`` must read the file instead."""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase  # torch's BatchNorm base: its loader is checked below

from fastckpt.format.safetensorsfile import st_dtype
from fastckpt.read.readers import tensor_bytes

from fastckpt.engine.loadwait import foreign_load_hooks

__all__ = ["ModelPlan", "plan_model"]

_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
# Modules whose _load_from_state_dict is nn.Module's, or differs only for old files lacking a key (BatchNorm's
# num_batches_tracked): for them, writing the file's bytes into the tensors is what load_state_dict does.
_PLAIN_LOADERS = (nn.Module._load_from_state_dict, _NormBase._load_from_state_dict)


@dataclass
class ModelPlan:
    """Where each byte of a safetensors file lands: the header, then (file offset, memory) ranges that cover the
    rest of the file exactly; what stock ``load_model`` would return."""

    header: bytes
    ranges: list[tuple[int, memoryview]]
    keep: list[torch.Tensor]  # scratch tensors the ranges write into (file keys the model lacks)
    missing: set[str]
    unexpected: list[str]


def plan_model(model: nn.Module, path: str, size: int, device: str, strict: bool,
                kwargs: dict[str, Any]) -> tuple[ModelPlan | None, str]:
    """The plan to read ``path`` into ``model``, or (None, why stock must read it)."""
    if kwargs or device != "cpu":
        return None, f"load_model arguments {sorted(kwargs)} / device {device!r}: stock reads it"
    for m in model.modules():
        if foreign_load_hooks(m):
            return None, f"{type(m).__name__} has load_state_dict hooks"
        if type(m)._load_from_state_dict not in _PLAIN_LOADERS:
            return None, f"{type(m).__name__} has its own _load_from_state_dict"
    try:
        header, entries = _read_header(path, size)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        return None, f"unreadable safetensors header ({e})"
    targets = model.state_dict(keep_vars=False)
    by_storage: dict[int, list[str]] = {}
    for key, t in targets.items():
        if type(t) is not torch.Tensor or t.device.type != "cpu" or t.layout is not torch.strided \
                or not t.is_contiguous() or t.is_conj() or t.is_neg():
            return None, f"tensor {key!r} is not a plain contiguous CPU tensor"
        if t.numel():
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(key)
    covered: set[str] = set()  # model keys another key of the file fills (tied weights, stored once)
    for keys in by_storage.values():
        if len(keys) < 2:
            continue
        first = targets[keys[0]]
        same = all(targets[k].data_ptr() == first.data_ptr() and targets[k].shape == first.shape
                   and targets[k].stride() == first.stride() and targets[k].dtype == first.dtype for k in keys)
        in_file = [k for k in keys if k in entries]
        if not same or len(in_file) != 1:
            return None, f"tensors {keys[:3]} share memory in a way only stock resolves"
        covered.update(k for k in keys if k not in entries)
    missing = {k for k in targets if k not in entries and k not in covered}
    unexpected = [k for k in entries if k not in targets]
    if strict and (missing or unexpected):
        return None, "keys differ (stock raises its error)"
    ranges: list[tuple[int, memoryview]] = []
    keep: list[torch.Tensor] = []
    end = 0
    base = len(header)
    for key, (dtype, shape, start, stop) in sorted(entries.items(), key=lambda kv: kv[1][2]):
        if start != end:
            return None, "the tensors do not cover the file back to back"
        end = stop
        t = targets.get(key)
        if t is None:  # not in the model (strict=False): read it anyway, the file's CRC covers it
            t = torch.empty(stop - start, dtype=torch.uint8)
            keep.append(t)
        elif list(t.shape) != shape or st_dtype(t.dtype) != dtype or (dtype == "U8" and t.dtype != torch.uint8) \
                or t.numel() * t.element_size() != stop - start:
            return None, f"tensor {key!r}: shape/dtype differ (stock raises its error or adapts it)"
        if start < stop:
            ranges.append((base + start, tensor_bytes(t)))
    if base + end != size:
        return None, "the file's size does not match its header"
    return ModelPlan(header, ranges, keep, missing, unexpected), ""


def _read_header(path: str, size: int) -> tuple[bytes, dict[str, tuple[str, list[int], int, int]]]:
    """The raw header (length + JSON) and each tensor's (dtype, shape, start, stop) within the data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"header length {n} does not fit the {size}-byte file")
        body = f.read(n)
    doc = json.loads(body)
    entries = {}
    for key, value in doc.items():
        if key == "__metadata__":
            continue
        start, stop = (int(x) for x in value["data_offsets"])
        if not 0 <= start <= stop:
            raise ValueError(f"tensor {key!r} has data_offsets {value['data_offsets']}")
        entries[key] = (str(value["dtype"]), [int(x) for x in value["shape"]], start, stop)
    return struct.pack("<Q", n) + body, entries
