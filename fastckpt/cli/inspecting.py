"""``fastckpt inspect CKPT``: the state tree (keys, dtypes, shapes, bytes) without reading tensor bytes.

Core checkpoints: the tensor table of the meta file, and every other value of the saved tree (the step,
an optimizer's ``param_groups``; objects of the objects file through the safe unpickler). Torch files
(Lightning ``.ckpt``): the pickle read under ``skip_data``. Accelerate folders: each stock file by name
(safetensors headers, torch pickles). DCP folders: the ``.metadata`` file.

The header names the training step the checkpoint records (a manifest's step, a ``.ckpt``'s
``global_step``, an Accelerate folder's optimizer step count). Keys that would leave the other columns
less than 40 characters of the terminal are shortened in the table (a callback's ``ModelCheckpoint{...}`` state key runs to 150 characters); ``--json``
prints them whole.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import sys
from typing import Any

from ..errors import FastCkptError, IntegrityError
from .layout import accelerate_files, accelerate_step, kind_of, locate, Located, pointer_parts, read_skeleton
from .options import CliOptions, print_json
from .states import leaves
from .text import clean, human_size, shorten_key, table

__all__ = ["describe", "run"]

_MAX_HEADER = 100 << 20  # a safetensors header larger than this is crafted, not a model's

# safetensors spells dtypes its own way (``F32``); every kind of checkpoint is shown in torch's spelling.
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
                       "U8": "uint8", "BOOL": "bool", "C64": "complex64"}


def describe(path: str, opts: CliOptions) -> dict[str, Any]:
    """``{"path", "kind", "step", "nbytes", "tensors": [{key, dtype, shape, nbytes}], "objects": [{key, type,
    value}]}``; ``step`` is the training step the checkpoint records, or None."""
    loc = locate(path, opts.storage_options)
    kind = kind_of(loc)
    tensors: list[dict[str, Any]] = []
    objects: list[dict[str, Any]] = []
    step = None
    if kind == "core":
        step = _core(loc.path, opts, "", tensors, objects)
    elif kind == "pointer":
        for part in pointer_parts(loc) or []:
            step = _core(part, opts, "", tensors, objects)
    elif kind == "torch":
        skeleton = read_skeleton(loc)
        _tree(skeleton, "", tensors, objects)
        found = skeleton.get("global_step") if isinstance(skeleton, dict) else None
        step = found if type(found) is int else None
    elif kind == "accelerate":
        _accelerate(loc, tensors, objects)
        step = accelerate_step(loc)
    else:
        _dcp(loc, tensors, objects)
    return {"path": loc.path, "kind": kind, "step": step, "nbytes": sum(t["nbytes"] for t in tensors),
            "tensors": tensors, "objects": objects}


def _row(key: str, dtype: Any, shape: Any, nbytes: int) -> dict[str, Any]:
    name = str(dtype).removeprefix("torch.")
    return {"key": key, "dtype": _SAFETENSORS_DTYPES.get(name, name), "shape": list(shape), "nbytes": int(nbytes)}


class _Slot:
    """Where a tensor of the table sits in a core checkpoint's tree (its row comes from the table itself)."""


class _Unreadable(list):
    """The objects of a checkpoint whose objects file the safe unpickler refuses: each shown as that refusal."""

    def __init__(self, why: str) -> None:
        super().__init__()
        self.why = why

    def __len__(self) -> int:
        return sys.maxsize

    def __getitem__(self, index: Any) -> Any:
        return _Refused(self.why)


class _Refused:
    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"not shown: {self.why}"


def _core(path: str, opts: CliOptions, prefix: str, tensors: list[dict[str, Any]],
          objects: list[dict[str, Any]]) -> int:
    """The tensor rows of a core checkpoint, and a row for every other value of its tree: plain values (the step, an
    optimizer's ``param_groups``) from the meta file, objects through the safe unpickler. Returns its step."""
    from .. import CheckpointReader, open_storage

    storage = open_storage(path, opts.storage_options)
    reader = CheckpointReader(storage, storage.url, verify=False)
    tensors.extend(_row(prefix + e.key, e.dtype, e.shape, e.nbytes) for e in reader.entries)
    try:
        table_objects: list[Any] = reader.objects()
    except FastCkptError as e:  # a class outside the allowlist: the tree is still shown around it
        table_objects = _Unreadable(f"{type(e).__name__}: {' '.join(str(e).split())[:120]}")
    slot = _Slot()
    tree = reader.decode([slot] * len(reader.entries), table_objects)
    for key, leaf in leaves(tree, prefix, sep="/"):
        if leaf is not slot:
            objects.append({"key": key, "type": type(leaf).__name__, "value": repr(leaf)[:80]})
    return reader.step


def _tree(obj: Any, prefix: str, tensors: list[dict[str, Any]], objects: list[dict[str, Any]]) -> None:
    import torch

    for key, leaf in leaves(obj, prefix):
        if isinstance(leaf, torch.Tensor):
            tensors.append(_row(key, leaf.dtype, leaf.shape, leaf.numel() * leaf.element_size()))
        else:
            objects.append({"key": key, "type": type(leaf).__name__, "value": repr(leaf)[:80]})


def _accelerate(loc: Located, tensors: list[dict[str, Any]], objects: list[dict[str, Any]]) -> None:
    for name, file, stem in accelerate_files(loc):
        if name.endswith(".safetensors"):
            tensors.extend(_row(f"{stem}.{k}", dtype, shape, nbytes) for k, dtype, shape, nbytes in _header(file))
            continue
        try:
            _tree(read_skeleton(file), stem, tensors, objects)
        except IntegrityError:  # random_states_N.pkl: a plain pickle, never unpickled here
            objects.append({"key": stem, "type": "pickle", "value": f"{file.storage.size(file.path)} bytes, "
                            "not readable with weights_only=True"})


def _header(file: Located) -> list[tuple[str, str, list[int], int]]:
    """(key, dtype, shape, nbytes) from a safetensors header: only its first bytes are read."""
    head = bytearray(8)
    file.storage.read_into(file.path, 0, memoryview(head))
    (n,) = struct.unpack("<Q", head)
    if n > min(_MAX_HEADER, file.storage.size(file.path) - 8):
        raise IntegrityError(f"{file.path}: the safetensors header length {n} does not fit the file")
    body = bytearray(n)
    file.storage.read_into(file.path, 8, memoryview(body))
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{file.path}: the safetensors header is not JSON: {e}") from e
    return [(k, v["dtype"], v["shape"], v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in header.items() if k != "__metadata__"]


def _dcp(loc: Located, tensors: list[dict[str, Any]], objects: list[dict[str, Any]]) -> None:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(loc.path).read_metadata()
    for key, item in meta.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            nbytes = item.size.numel() * item.properties.dtype.itemsize
            tensors.append(_row(key, item.properties.dtype, item.size, nbytes))
        else:
            objects.append({"key": key, "type": "bytes", "value": "a pickled object (DCP BytesStorage)"})


def run(args: argparse.Namespace, opts: CliOptions) -> int:
    info = describe(args.path, opts)
    if args.json:
        print_json(info)
        return 0
    tensors, objects = info["tensors"], info["objects"]
    step = "" if info["step"] is None else f"step {info['step']}, "
    print(clean(f"{info['path']}  ({info['kind']}, {step}{_count(len(tensors), 'tensor')}, "
                f"{human_size(info['nbytes'])}, {_count(len(objects), 'other value')})"))
    width = max(60, shutil.get_terminal_size((120, 24)).columns - 40)  # the rest: the other columns
    shortened = False

    def key(text: str) -> str:
        nonlocal shortened
        short = shorten_key(clean(text), width)
        shortened = shortened or short != clean(text)
        return short

    if tensors:
        rows = [(key(t["key"]), t["dtype"], _shape(t["shape"]), human_size(t["nbytes"])) for t in tensors]
        print("\n".join(table(("KEY", "DTYPE", "SHAPE", "SIZE"), rows, right=(3,))))
    if objects:
        print()
        print("\n".join(table(("KEY", "TYPE", "VALUE"), [(key(o["key"]), o["type"], o["value"]) for o in objects])))
    if shortened:
        print(f"(keys longer than {width} characters are shortened here; --json prints them whole)")
    return 0


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _shape(shape: list[int]) -> str:
    """``8x8``; a scalar is ``scalar``."""
    return "x".join(map(str, shape)) if shape else "scalar"
