"""Will this pickle load? torch's ``weights_only`` unpickler run over a torch file's ``data.pkl`` at save time.

A framework file is read back by a known loader: Accelerate reads ``optimizer.bin`` with ``torch.load(weights_only=
True)`` and its own safe globals, fastckpt reads a registered object's ``custom_checkpoint_N.pkl`` the same way plus
numpy's. A state that pickles fine but holds a class that loader refuses would only fail at the resume, months
later. ``check_loads`` runs torch's own weights-only unpickler over the skeleton the save wrote (storages stand in
on the ``meta`` device: no tensor byte is read or allocated), under exactly the globals the loader allows, and
``culprits`` names the key paths of the values it refuses. ``numpy_safe_globals`` is what numpy arrays and scalars
need (numeric, boolean, complex, date/time, bytes and str dtypes; never object dtypes): data, no code, as torch's
own documentation of ``weights_only`` allowlists them.
"""
from __future__ import annotations

import importlib
import io
import struct
import threading
import warnings
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from ..errors import UnsafeCheckpointError
from .zipdir import Sparse, central_entries, data_offset

__all__ = ["PickleLoader", "allowing", "check_loads", "culprits", "numpy_safe_globals", "pickle_of",
           "resolve_globals"]

_LOCK = threading.Lock()  # fastckpt's own additions to torch's process-wide safe globals, one block at a time
_MAX_CULPRITS = 5


@dataclass(frozen=True)
class PickleLoader:
    """The loader that will read a torch file: torch's ``weights_only`` unpickler with ``allowed`` (entries as
    ``torch.serialization.add_safe_globals`` takes them) beyond torch's own allowlist. ``reader`` names it and
    ``fix`` says what to do when it would refuse the file, in the error."""

    allowed: tuple[Any, ...]
    reader: str
    fix: str


def numpy_safe_globals() -> list[Any]:
    """The globals numpy arrays, scalars and their dtypes pickle through; empty without numpy. Files pickled under
    numpy 1.x name ``numpy.core.multiarray``, under 2.x ``numpy._core.multiarray``: both spellings are allowed."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is present wherever torch is useful
        return []
    try:  # numpy 2 moved numpy.core to numpy._core (the old name warns)
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # pragma: no cover - numpy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    out: list[Any] = [np.ndarray, np.dtype]
    for fn in (getattr(multiarray, "_reconstruct"), getattr(multiarray, "scalar")):
        out += [fn, (fn, f"numpy.core.multiarray.{fn.__name__}"), (fn, f"numpy._core.multiarray.{fn.__name__}")]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25: each dtype has a class its pickle's BUILD needs
    if dtypes is not None:
        for char in "?bhilqBHILQefdgFDGmMSUV":  # every kind but object ("O") and numpy 2's StringDType (objects)
            out.append(type(np.dtype(char)))
    return out


def resolve_globals(names: Iterable[str]) -> list[Any]:
    """The classes or functions named ``module.QualName`` (config ``allowed_classes``); ``UnsafeCheckpointError``
    naming one that cannot be imported."""
    out = []
    for name in names:
        module, _, attr = name.rpartition(".")
        try:
            target: Any = importlib.import_module(module)
            out.append(getattr(target, attr))
        except (ImportError, AttributeError, ValueError) as e:
            raise UnsafeCheckpointError(f"allowed class {name!r} cannot be imported: {e}") from e
    return out


@contextmanager
def allowing(extra: Sequence[Any]) -> Iterator[None]:
    """``extra`` added to torch's process-wide safe globals for the block; only what was not there already is
    removed afterwards (``torch.serialization.safe_globals`` removes all it was given, taking back what the user
    registered). The set is process-wide: another thread's ``torch.load`` sees ``extra`` meanwhile, which is why
    only globals that rebuild data (numpy's, torch's, the user's ``allowed_classes``) are ever passed here."""
    if not extra:
        yield
        return
    with _LOCK:
        have = set(torch.serialization.get_safe_globals())
        added = [g for g in dict.fromkeys(extra) if g not in have]
        torch.serialization.add_safe_globals(added)
    try:
        yield
    finally:
        with _LOCK:
            _remove(added)


def _remove(globals_: list[Any]) -> None:
    """Remove ``globals_`` from torch's safe globals: torch's own helper where it has one (one assignment, never
    an empty set in between), else clear and re-add the others (torch has no public call removing some)."""
    remove = getattr(torch._weights_only_unpickler, "_remove_safe_globals", None)  # noqa: SLF001
    if remove is not None:
        remove(globals_)
        return
    keep = [g for g in torch.serialization.get_safe_globals() if g not in set(globals_)]
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(keep)


def pickle_of(layout: Any) -> bytes:
    """The ``data.pkl`` record of a ``TorchFileLayout`` (torch stores it uncompressed), from its fixed bytes."""
    view = Sparse(layout.segments, layout.size)
    for name, header, central in central_entries(view):
        if name == "data.pkl":
            (size,) = struct.unpack("<I", view.read(central + 24, 4))  # uncompressed size
            return view.read(data_offset(view, header), size)
    raise UnsafeCheckpointError("torch.save wrote no data.pkl record: this torch version is not supported")


def check_loads(data: bytes, loader: PickleLoader) -> None:
    """Unpickle ``data`` (a torch file's ``data.pkl``) as ``loader`` will; raises what it raises (``UnpicklingError``
    naming the refused global, ...). Storages are rebuilt on the meta device: milliseconds, no tensor bytes."""

    def persistent_load(saved_id: Any) -> Any:
        _, storage_type, _key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        nbytes = numel * torch._utils._element_size(dtype)  # noqa: SLF001 - what torch's own loader computes
        return torch.storage.TypedStorage(wrap_storage=torch.UntypedStorage(nbytes, device="meta"), dtype=dtype,
                                          _internal=True)

    with allowing(loader.allowed), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage deprecation, from torch's own rebuild path
        unpickler = torch._weights_only_unpickler.Unpickler(io.BytesIO(data), encoding="utf-8")  # noqa: SLF001
        unpickler.persistent_load = persistent_load  # type: ignore[attr-defined]
        unpickler.load()


def culprits(obj: Any, loader: PickleLoader, dumps: Callable[[Any], bytes], path: str = "") -> list[str]:
    """The key paths (``state/0/buf (numpy.ndarray)``) of the leaves of ``obj`` that ``loader`` refuses alone,
    at most five; ``dumps``: a value's pickle as the writer makes it. Only run once the whole pickle was refused."""
    found: list[str] = []
    stack: list[tuple[str, Any, int]] = [(path, obj, 0)]
    while stack and len(found) < _MAX_CULPRITS:
        where, value, depth = stack.pop()
        if depth < 64 and type(value) in (dict, list, tuple, OrderedDict):  # subclasses pickle their class
            items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
            stack.extend((f"{where}/{k}" if where else str(k), v, depth + 1) for k, v in reversed(items))
            continue
        if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter):
            continue
        try:
            check_loads(dumps(value), loader)
        except Exception:  # noqa: BLE001 - any refusal marks this leaf
            found.append(f"{where or '<the whole object>'} ({type(value).__module__}.{type(value).__qualname__})")
    return found
