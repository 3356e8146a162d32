"""A torch file's object tree read without torch: ``data.pkl`` through an unpickler that only builds stand-ins.

``fastckpt list`` wants two integers from a Lightning ``.ckpt`` (``global_step``, ``epoch``) and one from an
Accelerate ``optimizer.bin`` (its optimizer's step count); importing torch for them cost a second of the
command's 1.7 s. Here the zip directory is read as data (``zipdir``), then ``data.pkl`` (kilobytes to a few MB,
never the tensor records) is unpickled by an ``Unpickler`` whose ``find_class`` imports nothing: containers and
scalars are themselves, a tensor becomes a ``TensorStub`` (dtype, shape, the record holding its bytes), and every
other global a ``Opaque`` stand-in that records its name and arguments. No code named by the file ever runs.

``Peeked.plain`` says whether every global the pickle named is one torch's ``weights_only`` loader allows by
default (a conservative subset of it). Where it is False the file may be one ``torch.load(weights_only=True)``
refuses (a pickled module): callers that must say so ask torch itself (``cli.layout.read_skeleton``).
"""
from __future__ import annotations

import codecs
import io
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import IntegrityError
from .zipdir import central_records, data_offset

__all__ = ["Peeked", "TensorStub", "Opaque", "View", "peek", "scalar_value"]

_MAX_PICKLE = 256 << 20  # a data.pkl larger than this is not a checkpoint's skeleton

# torch's storage types by pickled name: (dtype as torch names it, struct code of one value or None, item size)
_STORAGES = {
    "FloatStorage": ("float32", "f", 4), "DoubleStorage": ("float64", "d", 8), "HalfStorage": ("float16", "e", 2),
    "BFloat16Storage": ("bfloat16", None, 2), "LongStorage": ("int64", "q", 8), "IntStorage": ("int32", "i", 4),
    "ShortStorage": ("int16", "h", 2), "CharStorage": ("int8", "b", 1), "ByteStorage": ("uint8", "B", 1),
    "BoolStorage": ("bool", "?", 1), "ComplexFloatStorage": ("complex64", None, 8),
    "ComplexDoubleStorage": ("complex128", None, 16), "UntypedStorage": ("uint8", "B", 1),
}

# Globals that are data, as torch's weights_only loader allows them by default (a subset: anything else makes the
# peek not ``plain``).
_REAL: dict[str, Any] = {"collections.OrderedDict": OrderedDict, "builtins.set": set, "builtins.frozenset": frozenset,
                         "builtins.slice": slice, "builtins.complex": complex, "torch.Size": tuple,
                         "_codecs.encode": codecs.encode}
_PLAIN_OPAQUE = {"torch.device", "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_parameter",
                 "torch._utils._rebuild_parameter_with_state", "torch._tensor._rebuild_from_type_v2",
                 "torch.nn.parameter.Parameter"}
_DTYPES = {"float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
           "complex64", "complex128", "float", "double", "half", "long", "int", "short"}


class View(Protocol):
    """Random reads over one file (``cli.layout.FileView``; ``zipdir``'s views)."""

    size: int

    def read(self, offset: int, n: int) -> bytes: ...  # exactly ``n`` bytes at ``offset``


@dataclass(frozen=True, slots=True)
class TensorStub:
    """A tensor of the pickle: its dtype (torch's name), shape, and where its values are (record, element offset)."""

    dtype: str
    shape: tuple[int, ...]
    record: str
    offset: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.itemsize


class Opaque:
    """A stand-in for an object of a class the peek does not build: its global's name, arguments and state."""

    name = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "Opaque":  # REDUCE and NEWOBJ both land here
        obj = object.__new__(cls)
        obj.args, obj.state, obj.items = args, None, {}
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:  # BUILD
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM(S) on a dict subclass
        self.items[key] = value

    def append(self, value: Any) -> None:  # APPEND(S) on a list subclass
        self.items[len(self.items)] = value

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)

    def __repr__(self) -> str:
        return f"<{self.name}>"


@dataclass(frozen=True, slots=True)
class Peeked:
    """The pickle's tree, and whether it named only globals torch's safe loader allows by default."""

    tree: Any
    plain: bool
    globals: frozenset[str]


@dataclass(frozen=True, slots=True)
class _StorageRef:
    record: str
    dtype: str
    itemsize: int


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.named: set[str] = set()
        self._classes: dict[str, type] = {}

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        self.named.add(full)
        if full in _REAL:
            return _REAL[full]
        if full == "torch._utils._rebuild_tensor_v2" or full == "torch._utils._rebuild_tensor":
            return _rebuild_tensor
        if full in ("torch._utils._rebuild_parameter", "torch._utils._rebuild_parameter_with_state"):
            return lambda data, *_: data
        if full == "torch._tensor._rebuild_from_type_v2":
            return lambda fn, _type, args, _state: fn(*args)
        if module == "torch" and name in _STORAGES:
            return _storage_type(name)
        if full not in self._classes:
            self._classes[full] = type(name, (Opaque,), {"name": full})
        return self._classes[full]

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            kind = getattr(pid[1], "storage_name", None)
            if kind is None:
                raise pickle.UnpicklingError(f"a storage of type {pid[1]!r:.60}")
            dtype, _, itemsize = _STORAGES[kind]
            return _StorageRef(f"data/{pid[2]}", dtype, itemsize)
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r:.60}")


def _storage_type(name: str) -> type:
    return type(name, (), {"storage_name": name})


def _rebuild_tensor(storage: Any, offset: Any, size: Any, *_: Any) -> TensorStub:
    if not isinstance(storage, _StorageRef) or type(offset) is not int or not isinstance(size, (tuple, list)):
        raise pickle.UnpicklingError("a tensor record that is not a storage, an offset and a shape")
    return TensorStub(storage.dtype, tuple(int(d) for d in size), storage.record, offset, storage.itemsize)


def peek(view: View, source: str) -> Peeked:
    """The object tree of the torch zip file ``view`` (its ``data.pkl`` only); IntegrityError naming ``source`` when
    it is no torch zip file or its pickle does not parse."""
    try:
        records = {name: (header, size) for name, header, size, _ in central_records(view)}
        if "data.pkl" not in records:
            raise IntegrityError("no data.pkl record")
        header, size = records["data.pkl"]
        if size > _MAX_PICKLE:
            raise IntegrityError(f"data.pkl is {size} bytes")
        data = view.read(data_offset(view, header), size)
        unpickler = _Unpickler(data)
        tree = unpickler.load()
    except IntegrityError as e:
        raise IntegrityError(f"{source}: not a torch zip file ({e})") from e
    except (pickle.UnpicklingError, struct.error, EOFError, ValueError, TypeError, KeyError, AttributeError,
            IndexError, RecursionError, MemoryError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{source}: its pickle does not parse ({type(e).__name__}: {str(e)[:120]})") from e
    plain = all(g in _REAL or g in _PLAIN_OPAQUE or (g.startswith("torch.") and g[6:] in _STORAGES)
                or (g.startswith("torch.") and g[6:] in _DTYPES) for g in unpickler.named)
    return Peeked(tree, plain, frozenset(unpickler.named))


def scalar_value(view: View, tensor: TensorStub) -> int | float | bool | None:
    """The value of a one-element tensor of the peeked file (its record's few bytes); None for another shape or a
    dtype without a plain struct code (bfloat16, complex)."""
    code = _STORAGES.get(next((k for k, v in _STORAGES.items() if v[0] == tensor.dtype), ""), (None, None))[1]
    if code is None or tensor.nbytes != tensor.itemsize:
        return None
    records = {name: header for name, header, _size, _ in central_records(view)}
    if tensor.record not in records:
        raise IntegrityError(f"the record {tensor.record!r} a tensor names is missing")
    start = data_offset(view, records[tensor.record]) + tensor.offset * tensor.itemsize
    (value,) = struct.unpack("<" + code, view.read(start, tensor.itemsize))
    return value
