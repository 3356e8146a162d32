"""``fastckpt inspect CKPT``: the state tree (keys, dtypes, shapes, bytes) without reading tensor bytes.

Core checkpoints: the tensor table of the meta file. Torch files (Lightning ``.ckpt``): the pickle
read under ``skip_data``. Accelerate folders: each stock file by name (safetensors headers, torch
pickles). DCP folders: the ``.metadata`` file.
"""
from __future__ import annotations

import argparse
import json
import struct
from typing import Any

from ..errors import IntegrityError
from .layout import accelerate_files, kind_of, locate, Located, pointer_parts, read_skeleton
from .options import CliOptions, print_json
from .states import leaves
from .text import clean, human_size, table

__all__ = ["describe", "run"]

_MAX_HEADER = 100 << 20  # a safetensors header larger than this is crafted, not a model's

# safetensors spells dtypes its own way (``F32``); every kind of checkpoint is shown in torch's spelling.
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16",
                       "U8": "uint8", "BOOL": "bool", "C64": "complex64"}


def describe(path: str, opts: CliOptions) -> dict[str, Any]:
    """``{"path", "kind", "tensors": [{key, dtype, shape, nbytes}], "objects": [{key, type, value}]}``."""
    loc = locate(path, opts.storage_options)
    kind = kind_of(loc)
    tensors: list[dict[str, Any]] = []
    objects: list[dict[str, Any]] = []
    if kind == "core":
        _core(loc.path, opts, "", tensors)
    elif kind == "pointer":
        for part in pointer_parts(loc) or []:
            _core(part, opts, "", tensors)
    elif kind == "torch":
        _tree(read_skeleton(loc), "", tensors, objects)
    elif kind == "accelerate":
        _accelerate(loc, tensors, objects)
    else:
        _dcp(loc, tensors, objects)
    return {"path": loc.path, "kind": kind, "nbytes": sum(t["nbytes"] for t in tensors), "tensors": tensors,
            "objects": objects}


def _row(key: str, dtype: Any, shape: Any, nbytes: int) -> dict[str, Any]:
    name = str(dtype).removeprefix("torch.")
    return {"key": key, "dtype": _SAFETENSORS_DTYPES.get(name, name), "shape": list(shape), "nbytes": int(nbytes)}


def _core(path: str, opts: CliOptions, prefix: str, out: list[dict[str, Any]]) -> None:
    from .. import CheckpointReader, open_storage

    storage = open_storage(path, opts.storage_options)
    reader = CheckpointReader(storage, storage.url, verify=False)
    out.extend(_row(prefix + e.key, e.dtype, e.shape, e.nbytes) for e in reader.entries)


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
    print(clean(f"{info['path']}  ({info['kind']}, {_count(len(tensors), 'tensor')}, {human_size(info['nbytes'])}, "
                f"{_count(len(objects), 'other value')})"))
    if tensors:
        rows = [(t["key"], t["dtype"], _shape(t["shape"]), human_size(t["nbytes"])) for t in tensors]
        print("\n".join(table(("KEY", "DTYPE", "SHAPE", "SIZE"), rows, right=(3,))))
    if objects:
        print()
        print("\n".join(table(("KEY", "TYPE", "VALUE"), [(o["key"], o["type"], o["value"]) for o in objects])))
    return 0


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _shape(shape: list[int]) -> str:
    """``8x8``; a scalar is ``scalar``."""
    return "x".join(map(str, shape)) if shape else "scalar"
