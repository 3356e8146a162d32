"""Safe encoding of the state tree: JSON for structure and plain values.

Tensors are replaced by ``{"T": index}`` references into the tensor table. Plain
values (None, bool, int, float, str, bytes, numpy scalars, dtypes, devices, sizes)
and containers (dict with any plain keys, OrderedDict, list, tuple) are JSON. Any
other object is pickled at save time and later rebuilt only through torch's
``weights_only`` unpickler with an explicit allowlist, so loading never runs
arbitrary code. The pickled objects are test-loaded at save time: an object that
could not be loaded back fails the ``save()`` call, not the restore months later.
"""
from __future__ import annotations

import base64
import importlib
import io
import math
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch

from .errors import UnsafeCheckpointError

__all__ = ["encode_tree", "decode_tree", "dumps_objects", "loads_objects"]

try:  # numpy is optional; torch ships without requiring it
    import numpy as np
except ImportError:  # pragma: no cover - numpy is present wherever torch is useful
    np = None  # type: ignore[assignment]


def _float(v: float) -> Any:
    if math.isfinite(v):
        return v
    return {"F": repr(v)}  # 'nan', 'inf', '-inf': strict JSON has no such literals


def encode_tree(
    obj: Any,
    on_tensor: Callable[[tuple, torch.Tensor, bool], int],
    objects: list[Any],
    path: tuple = (),
) -> Any:
    """Encode ``obj``; ``on_tensor(path, tensor, is_numpy)`` returns the tensor's table index."""
    # Exact-type fast paths first: this walk runs inside save(), on every checkpoint.
    kind = type(obj)
    if kind is torch.Tensor:
        return {"T": on_tensor(path, obj, False)}
    if kind is dict or kind is OrderedDict:
        out = {"D": [[encode_tree(k, on_tensor, objects, path), encode_tree(v, on_tensor, objects, path + (k,))]
                     for k, v in obj.items()]}
        if kind is OrderedDict:
            out["o"] = 1
        return out
    if kind is str or kind is int or kind is bool or obj is None:
        return obj
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int) and type(obj) is int:
        return obj
    if type(obj) is float:
        return _float(obj)
    if isinstance(obj, torch.Tensor):
        return {"T": on_tensor(path, obj, False)}
    if np is not None and isinstance(obj, np.ndarray) and obj.dtype != object:
        return {"T": on_tensor(path, torch.from_numpy(obj), True)}
    if np is not None and isinstance(obj, np.generic) and not isinstance(obj, np.object_):
        return {"N": obj.dtype.str, "v": _float(obj.item()) if isinstance(obj.item(), float) else obj.item()}
    if isinstance(obj, bytes):
        return {"B": base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, torch.dtype):
        return {"dt": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"dv": str(obj)}
    if isinstance(obj, torch.Size):
        return {"S": list(obj)}
    if isinstance(obj, dict):
        items = [[encode_tree(k, on_tensor, objects, path), encode_tree(v, on_tensor, objects, path + (k,))]
                 for k, v in obj.items()]
        # dict subclasses (AttributeDict, defaultdict) come back as plain dicts: their
        # class is recorded for humans, never imported.
        out: dict[str, Any] = {"D": items}
        if isinstance(obj, OrderedDict):
            out["o"] = 1
        elif type(obj) is not dict:
            out["cls"] = f"{type(obj).__module__}.{type(obj).__qualname__}"
        return out
    if type(obj) is list:
        return {"L": [encode_tree(v, on_tensor, objects, path + (i,)) for i, v in enumerate(obj)]}
    if type(obj) is tuple:
        return {"U": [encode_tree(v, on_tensor, objects, path + (i,)) for i, v in enumerate(obj)]}
    objects.append(obj)
    return {"P": len(objects) - 1}


def decode_tree(node: Any, tensors: list[Any], objects: list[Any]) -> Any:
    """Rebuild the tree encoded by ``encode_tree``."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if not isinstance(node, dict) or len(node) == 0:
        raise ValueError(f"malformed tree node {node!r:.80}")
    if "T" in node:
        return tensors[node["T"]]
    if "D" in node:
        pairs = ((decode_tree(k, tensors, objects), decode_tree(v, tensors, objects)) for k, v in node["D"])
        return OrderedDict(pairs) if node.get("o") else dict(pairs)
    if "L" in node:
        return [decode_tree(v, tensors, objects) for v in node["L"]]
    if "U" in node:
        return tuple(decode_tree(v, tensors, objects) for v in node["U"])
    if "F" in node:
        return float(node["F"])
    if "B" in node:
        return base64.b64decode(node["B"])
    if "N" in node:
        if np is None:
            raise ValueError("this checkpoint holds numpy scalars; install numpy to load it")
        value = node["v"]
        return np.dtype(node["N"]).type(float(value["F"]) if isinstance(value, dict) else value)
    if "dt" in node:
        dtype = getattr(torch, node["dt"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {node['dt']!r}")
        return dtype
    if "dv" in node:
        return torch.device(node["dv"])
    if "S" in node:
        return torch.Size(node["S"])
    if "P" in node:
        return objects[node["P"]]
    raise ValueError(f"malformed tree node with keys {sorted(node)}")


def _resolve(names: Iterable[str]) -> list[Any]:
    out = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            target: Any = importlib.import_module(module)
            out.append(getattr(target, attr))
        except (ImportError, AttributeError, ValueError) as e:
            raise UnsafeCheckpointError(f"allowed class {name!r} cannot be imported: {e}") from e
    return out


def loads_objects(data: bytes, allowed: Iterable[str], source: str) -> list[Any]:
    """Unpickle the object table with torch's weights_only unpickler and the allowlist."""
    try:
        with torch.serialization.safe_globals(_resolve(allowed)):
            objects = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # the unpickler raises UnpicklingError or RuntimeError
        raise UnsafeCheckpointError(
            f"{source}: refused to rebuild a non-allowlisted object ({e}). If you trust this "
            "checkpoint and the class, add its 'module.QualName' to config allowed_classes."
        ) from e
    if not isinstance(objects, list):
        raise UnsafeCheckpointError(f"{source}: object table is not a list; not a fastckpt file")
    return objects


def dumps_objects(objects: list[Any], allowed: Iterable[str]) -> bytes:
    """Pickle the object table, then prove it loads back under the same allowlist."""
    kinds = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in objects})
    buf = io.BytesIO()
    try:
        torch.save(objects, buf)
    except Exception as e:  # pickling errors come as AttributeError, TypeError, PicklingError
        raise UnsafeCheckpointError(f"state holds objects that cannot be serialized ({kinds}): {e}") from e
    data = buf.getvalue()
    try:
        loads_objects(data, allowed, "save()")
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(
            f"state holds objects the safe loader would refuse: {kinds}. Convert them to plain "
            "values, or list the classes in config allowed_classes."
        ) from e
    return data
