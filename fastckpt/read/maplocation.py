"""``map_location`` for ``load()``, with ``torch.load``'s meanings, resolved on the calling thread.

Tensors are read into host memory by worker threads, but they are placed on the calling
thread: a bare ``"cuda"`` means the caller's current device (a worker thread's is always
device 0, which put every DDP rank's checkpoint on GPU 0), and a callable runs where the
user called ``load()``. The *location* a tensor was saved from is the table's optional
``device`` field (``"cpu"`` when absent), so ``{"cuda:0": "cuda:1"}`` moves exactly what
``torch.load`` would move.

Unlike ``torch.load``, ``map_location=None`` keeps every tensor on the CPU, and so does a
callable that returns ``None`` (``torch.load`` then falls back to its default, as here).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import ConfigError, IntegrityError

__all__ = ["Placer", "placer", "saved_location"]

Placer = Callable[[torch.Tensor, str], torch.Tensor]
"""``place(host_tensor, saved_location) -> tensor``: called on the thread that called ``load()``."""


def placer(map_location: Any) -> Placer | None:
    """Called by ``load()`` on the calling thread: how to place each tensor (None: keep them on the CPU)."""
    if map_location is None:
        return None
    if callable(map_location):
        return _call(map_location)
    if isinstance(map_location, dict):
        table = {str(k): _device(v, "map_location value") for k, v in map_location.items()}
        return lambda t, loc: _move(t, table.get(loc, _device(loc, "saved location")))
    device = _device(map_location, "map_location")
    return lambda t, loc: _move(t, device)


def saved_location(row: dict[str, Any], source: str) -> str:
    """The ``device`` a table row was saved from (``"cpu"`` when the field is absent)."""
    loc = row.get("device", "cpu")
    try:
        torch.device(loc)
    except (TypeError, RuntimeError) as e:
        raise IntegrityError(f"{source}: tensor {row.get('key')!r} has an invalid device {loc!r}; the file is "
                             "corrupt or foreign") from e
    return loc


def _call(fn: Callable[[torch.Tensor, str], Any]) -> Placer:
    def place(t: torch.Tensor, loc: str) -> torch.Tensor:
        out = fn(t, loc)
        if out is None:  # torch.load: the default placement, which here is the CPU
            return t
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"map_location callable returned {type(out).__name__} for a tensor saved on {loc!r}; "
                              "it must return the tensor it was given, moved (e.g. t.cuda(1)), or None")
        return out
    return place


def _device(value: Any, what: str) -> torch.device:
    try:
        device = torch.device(value)
    except (TypeError, RuntimeError) as e:
        raise ConfigError(f"{what} {value!r} is not a device; use a device string such as 'cpu' or 'cuda:1', "
                          "a torch.device, a dict of them, or a callable") from e
    if device.type == "cuda" and device.index is None:
        # torch.load's "cuda": the current device of the calling thread, fixed now rather than
        # left to the thread that happens to move the tensor
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device)
