"""Capture and restore the random number generators of one process, as Accelerate's ``random_states_{rank}.pkl``.

The states pass through fastckpt's plain-object encoding (JSON-like: tuples may come back as lists, numpy
arrays as tensors), so ``restore`` rebuilds the exact types each ``set_state`` function insists on.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_states() -> dict[str, Any]:
    """The states of every generator Accelerate saves on this process (CPU, CUDA, XPU when present)."""
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    # Only read device generators that exist: querying CUDA would otherwise initialize a context.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        states["xpu"] = torch.xpu.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put every generator back to the state ``capture_rng_states`` recorded."""
    random.setstate(_python_state(states["python"]))
    np.random.set_state(_numpy_state(states["numpy"]))
    torch.set_rng_state(byte_tensor(states["torch"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([byte_tensor(s) for s in states["cuda"]])
    if "xpu" in states and hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.set_rng_state_all([byte_tensor(s) for s in states["xpu"]])


def _python_state(state: Any) -> tuple:
    # random.setstate rejects lists: it wants (version, tuple_of_625_ints, gauss_next).
    version, internal, gauss_next = state
    return (int(version), tuple(int(x) for x in _to_list(internal)), gauss_next)


def _numpy_state(state: Any) -> tuple:
    # ('MT19937', uint32[624], pos, has_gauss, cached_gaussian); the key array may come back as a tensor.
    kind, key, pos, has_gauss, cached = state
    key_array = np.asarray(_to_list(key) if isinstance(key, torch.Tensor) else key, dtype=np.uint32)
    return (str(kind), key_array, int(pos), int(has_gauss), float(cached))


def byte_tensor(state: Any) -> torch.Tensor:
    if isinstance(state, torch.Tensor):
        # clone(): loaded tensors are views into a shared file buffer, and Generator.set_state reads the
        # storage from its start, ignoring storage_offset (invalid state or a segfault).
        return state.to(device="cpu", dtype=torch.uint8).clone(memory_format=torch.contiguous_format)
    return torch.as_tensor(np.asarray(state, dtype=np.uint8))


def _to_list(values: Any) -> list:
    if isinstance(values, torch.Tensor):
        # uint32 tensors have few kernels; go through int64 to read them.
        return values.to(torch.int64).tolist() if values.dtype != torch.int64 else values.tolist()
    return list(values)
