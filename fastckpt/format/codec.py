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
import io
import math
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence

import torch

from ..errors import StateMismatchError, UnsafeCheckpointError
from .picklecheck import allowing, numpy_safe_globals, resolve_globals

__all__ = ["encode_tree", "decode_tree", "dumps_objects", "loads_objects", "path_name", "MAX_NESTING"]

try:  # numpy is optional; torch ships without requiring it
    import numpy as np
except ImportError:  # pragma: no cover - numpy is present wherever torch is useful
    np = None  # type: ignore[assignment]


_JSON_INT = (-(1 << 63), 1 << 64)  # wider ints travel as hex: json refuses ints of over 4300 decimal digits
_NUMPY_VALUE_KINDS = "biuf"  # numpy scalar kinds stored as a readable JSON value; others as raw bytes
# Containers a state may nest. Each adds at most 3 JSON levels ({"D": [[k, v]]}), and loading refuses a
# meta tree deeper than 200 levels (a crafted file would break the recursive decoder): so save() refuses
# what load could not read. Real states nest a handful of levels.
MAX_NESTING = 64


def path_name(path: tuple) -> str:
    """The key path of a value in the state, as errors and the tensor table name it."""
    return "/".join(map(str, path)) or "tensor"


def _refuse(path: tuple, what: str, fix: str) -> StateMismatchError:
    return StateMismatchError(f"cannot checkpoint the value at {path_name(path)!r}: {what}; {fix}")


def _float(v: float) -> Any:
    if math.isfinite(v):
        return v
    return {"F": repr(v)}  # 'nan', 'inf', '-inf': strict JSON has no such literals


def _int(v: int) -> Any:
    return v if _JSON_INT[0] <= v < _JSON_INT[1] else {"I": hex(v)}


def _numpy_scalar(obj: Any, path: tuple) -> dict[str, Any]:
    dtype = obj.dtype
    if dtype.hasobject or dtype.fields is not None:
        raise _refuse(path, f"numpy scalar of structured dtype {dtype}",
                      "store its fields as separate values (obj.item() gives a tuple)")
    if dtype.kind in _NUMPY_VALUE_KINDS and dtype.itemsize <= 8:
        value = obj.item()
        return {"N": dtype.str, "v": _float(value) if isinstance(value, float) else value}
    # complex, datetime64/timedelta64, bytes_, str_, void, longdouble: the exact bytes
    return {"N": dtype.str, "b": base64.b64encode(obj.tobytes()).decode("ascii")}


def _numpy_array(obj: Any, path: tuple) -> torch.Tensor:
    if not obj.dtype.isnative:
        raise _refuse(path, f"numpy array of non-native byte order {obj.dtype.str!r}",
                      "convert it with a.astype(a.dtype.newbyteorder('='))")
    if any(st < 0 for st in obj.strides):
        obj = np.ascontiguousarray(obj)  # torch cannot view negative strides; numpy leaves are copied in save()
    try:
        return torch.from_numpy(obj)
    except TypeError as e:
        raise _refuse(path, f"numpy array of dtype {obj.dtype} has no torch dtype ({e})",
                      "convert it to a numeric dtype (datetime64: a.astype(np.int64)) or to a list") from e


def encode_tree(
    obj: Any,
    on_tensor: Callable[[tuple, torch.Tensor, bool], int],
    objects: list[Any],
    path: tuple = (),
    object_keys: list[str] | None = None,
) -> Any:
    """Encode ``obj``; ``on_tensor(path, tensor, is_numpy)`` returns the tensor's table index.

    Raises ``StateMismatchError`` naming the key path for a value that could not be written or
    read back (a cycle, nesting past ``MAX_NESTING``, a structured numpy scalar, ...): inside save(),
    never in the background.
    ``object_keys`` receives the key path of each pickled leaf appended to ``objects``."""
    return _Encoder(on_tensor, objects, object_keys if object_keys is not None else []).encode(obj, path)


class _Encoder:
    """One walk over a state. ``active`` holds the containers on the current path: a cycle is an error."""

    __slots__ = ("on_tensor", "objects", "object_keys", "active")

    def __init__(self, on_tensor: Callable[[tuple, torch.Tensor, bool], int], objects: list[Any],
                 object_keys: list[str]) -> None:
        self.on_tensor = on_tensor
        self.objects = objects
        self.object_keys = object_keys
        self.active: set[int] = set()

    def encode(self, obj: Any, path: tuple) -> Any:
        # Exact-type fast paths first: this walk runs inside save(), on every checkpoint.
        kind = type(obj)
        if kind is torch.Tensor:
            return {"T": self.on_tensor(path, obj, False)}
        if kind is str or kind is bool or obj is None:
            return obj
        if kind is int:
            return _int(obj)
        if kind is float:
            return _float(obj)
        if kind is list or kind is tuple or isinstance(obj, dict):
            return self._container(obj, path)
        return self._leaf(obj, path)  # torch.Size and namedtuples too: tuples, but not plain ones

    def _container(self, obj: Any, path: tuple) -> Any:
        ident = id(obj)
        if ident in self.active:
            raise _refuse(path, f"this {type(obj).__name__} contains itself (a reference cycle)",
                          "break the cycle before saving (store an index or a name instead of the reference)")
        if len(self.active) >= MAX_NESTING:  # ``active`` is exactly the containers around this one
            raise _refuse(path, f"containers are nested more than {MAX_NESTING} deep", "flatten the state")
        self.active.add(ident)
        try:
            return self._container_body(obj, path)
        finally:
            self.active.discard(ident)

    def _container_body(self, obj: Any, path: tuple) -> Any:
        kind = type(obj)
        if isinstance(obj, dict):
            items = [[self.encode(k, path), self.encode(v, path + (k,))] for k, v in obj.items()]
            # dict subclasses (AttributeDict, defaultdict) come back as plain dicts: their
            # class is recorded for humans, never imported.
            out: dict[str, Any] = {"D": items}
            if isinstance(obj, OrderedDict):
                out["o"] = 1
            elif kind is not dict:
                out["cls"] = f"{kind.__module__}.{kind.__qualname__}"
            return out
        if kind is list:
            return {"L": [self.encode(v, path + (i,)) for i, v in enumerate(obj)]}
        return {"U": [self.encode(v, path + (i,)) for i, v in enumerate(obj)]}

    def _leaf(self, obj: Any, path: tuple) -> Any:
        if np is not None and isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return _numpy_scalar(obj, path)  # before str/int: np.str_ is a str, np.bool_ is not a bool
        if isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            return {"T": self.on_tensor(path, obj, False)}
        if np is not None and isinstance(obj, np.ndarray) and obj.dtype != object:
            return {"T": self.on_tensor(path, _numpy_array(obj, path), True)}
        if isinstance(obj, bytes):
            return {"B": base64.b64encode(obj).decode("ascii")}
        if isinstance(obj, torch.dtype):
            return {"dt": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"dv": str(obj)}
        if isinstance(obj, torch.Size):
            return {"S": list(obj)}
        return self._pickled(obj, path)

    def _pickled(self, obj: Any, path: tuple) -> Any:
        self.objects.append(obj)
        self.object_keys.append(path_name(path))
        return {"P": len(self.objects) - 1}


def decode_tree(node: Any, tensors: list[Any], objects: list[Any]) -> Any:
    """Rebuild the tree encoded by ``encode_tree``."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if not isinstance(node, dict) or len(node) == 0:
        raise ValueError(f"malformed tree node {node!r:.80}")
    if "T" in node:
        return tensors[_index(node["T"], len(tensors), "tensor")]
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
    if "I" in node:
        return int(node["I"], 16)
    if "N" in node:
        return _decode_numpy(node)
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
        return objects[_index(node["P"], len(objects), "object")]
    raise ValueError(f"malformed tree node with keys {sorted(node)}")


def _index(raw: Any, count: int, table: str) -> int:
    """A reference into the tensor or object table: an int in ``range(count)``. Python would read -1 as the last
    entry (a crafted tree then loads some other tensor, silently) and True as 1."""
    if type(raw) is not int or not 0 <= raw < count:
        raise ValueError(f"the tree refers to {table} {raw!r:.40}, but the {table} table holds {count} "
                         f"(a reference is an integer from 0 to {count - 1})")
    return raw


def _decode_numpy(node: dict[str, Any]) -> Any:
    if np is None:
        raise ValueError("this checkpoint holds numpy scalars; install numpy to load it")
    dtype = np.dtype(node["N"])
    if dtype.hasobject:
        raise ValueError(f"numpy scalar of object dtype {node['N']!r} in the tree; the file is corrupt or foreign")
    if "b" in node:
        raw = base64.b64decode(node["b"])
        if len(raw) != dtype.itemsize:
            raise ValueError(f"numpy scalar of dtype {node['N']!r} holds {len(raw)} bytes, not {dtype.itemsize}")
        return np.frombuffer(raw, dtype=dtype)[0]
    value = node["v"]
    return dtype.type(float(value["F"]) if isinstance(value, dict) else value)


def loads_objects(data: bytes, allowed: Iterable[str], source: str) -> list[Any]:
    """Unpickle the object table with torch's weights_only unpickler, numpy's arrays and scalars and the allowlist."""
    try:
        with allowing([*numpy_safe_globals(), *resolve_globals(allowed)]):
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


def dumps_objects(objects: list[Any], allowed: Iterable[str], keys: Sequence[str] = ()) -> bytes:
    """Pickle the object table, then prove it loads back under the same allowlist.

    ``keys`` (the key path of each object) lets the error name the values at fault."""
    allowed = list(allowed)
    kinds = sorted({_qualname(o) for o in objects})
    try:
        data = _pickle(objects)
    except Exception as e:  # pickling errors come as AttributeError, TypeError, PicklingError
        raise UnsafeCheckpointError(f"state holds objects that cannot be serialized ({kinds}"
                                    f"{_culprits(objects, keys, allowed)}): {e}") from e
    try:
        loads_objects(data, allowed, "save()")
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(
            f"state holds objects the safe loader would refuse: {kinds}{_culprits(objects, keys, allowed)}. "
            "Convert them to plain values, or list the classes in config allowed_classes."
        ) from e
    return data


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _pickle(objects: list[Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(objects, buf)
    return buf.getvalue()


def _culprits(objects: list[Any], keys: Sequence[str], allowed: list[str]) -> str:
    """`` at 'a/b' (cls), ...``: the objects that fail alone (only computed on the error path)."""
    bad = []
    for obj, key in zip(objects, keys):
        try:
            loads_objects(_pickle([obj]), allowed, "save()")
        except Exception:  # noqa: BLE001 - any failure marks this object as a culprit
            bad.append(f"{key!r} ({_qualname(obj)})")
    return f" at {', '.join(bad[:5])}" if bad else ""
