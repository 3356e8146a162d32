"""Read a checkpoint folder fast under Accelerate's own ``load_state``: the model straight into its parameters,
the torch files into memory of their own, every byte checked as it is read (one pass, no verification pass).

Stock ``load_state`` stays in charge of *what* is restored and in which order (load pre-hooks, ``map_location``,
``strict``, optimizers, schedulers, samplers, the scaler, RNG states, ``step``, custom objects); only the
functions it reads files with are replaced for the duration of the call (``foreign.load_accelerate_folder``):

- ``accelerate.checkpointing.load_model`` (safetensors' ``load_model``), for ``model.safetensors``: the header is
  parsed, each tensor's byte range is read (``fastckpt.read.readers.read_ranges``: parallel ``preadv``) into the
  storage of the parameter or buffer it belongs to, each piece's CRC32C is taken by the thread that read it, and
  the pieces' values are combined (``fastckpt.format.checksum.combine``) with the header's into the file's CRC32C, which
  the manifest lists. Where the model is not a plain CPU module that takes the file as it is (a key, shape or
  dtype mismatch, tied weights stored twice, load_state_dict hooks, a custom ``_load_from_state_dict``, CUDA
  tensors, a file layout with holes) the file is checked by a pass over a mapping and stock ``load_model`` reads
  it: its errors are stock's, and ``strict=False`` returns what stock returns.
- ``accelerate.checkpointing.load`` (``torch.load`` with Accelerate's safe globals), for ``optimizer.bin``,
  ``scheduler.bin``, ``random_states_N.pkl``, ...: ``precheck`` read each file whole, in parallel pieces, into
  anonymous memory (populated up front: ``MAP_POPULATE``) and checked its CRC32C as the pieces arrived; torch's
  own loader then unpickles over those bytes (``weights_only`` as stock asked), as ``torch.load(mmap=True)`` does
  over a mapping: the loaded tensors are views of that memory, no second copy. A mapping was measured first and
  dropped: the optimizer's first step after the load then paid a copy-on-write fault per 4 KiB page (+0.7-1.0 s
  for 1 GB of AdamW state on the benchmark VM, more than the load saved).

``precheck`` runs before stock ``load_state`` touches anything, so a damaged or truncated torch file is an
``IntegrityError`` naming it before the model is written. The one exception is ``model.safetensors`` itself: its
bytes land in the parameters as they are checked, so damage is detected after every one of its tensors was
written: the model then holds the file's (damaged) values, nothing else (optimizer, scheduler, RNG, ...) was
loaded, and the error says so. A size that differs from the manifest is caught before anything is read.

A stock folder (no manifest) gets what its format offers: the torch files' zip records are checked against their
CRC-32 once read; a safetensors file has no checksum.
"""
from __future__ import annotations

import json
import mmap
import os
import pickle
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase  # torch's BatchNorm base: its loader is checked below

from fastckpt import LocalStorage
from fastckpt.format.checksum import combine, crc32c
from fastckpt.errors import IntegrityError
from fastckpt.format.safetensorsfile import st_dtype
from fastckpt.read.readers import PIECE_BYTES, Range, prefetch, read_ranges, tensor_bytes
from fastckpt.format.torchfile import is_zip, record_spans
from fastckpt.read.torchzip import check_records

__all__ = ["FolderReader", "LoadStateStats"]

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: allocate a mapping's pages when it is made
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
# Modules whose _load_from_state_dict is nn.Module's, or differs only for old files lacking a key (BatchNorm's
# num_batches_tracked): for them, writing the file's bytes into the tensors is what load_state_dict does.
_PLAIN_LOADERS = (nn.Module._load_from_state_dict, _NormBase._load_from_state_dict)


@dataclass
class LoadStateStats:
    """What one ``load_state`` did: ``FastAccelerateCheckpointing.last_load_stats``.

    ``files`` maps each file read to how: ``"into"`` (read straight into the model's tensors), ``"read"``
    (read whole, checked, and unpickled over those bytes), ``"stock"`` (read by Accelerate's own code; checked
    first where the manifest lists it). ``fallbacks``: why a file did not take the fast path (``"*"``: the whole
    load). ``verified``: every byte read was checked against the manifest (False for a stock folder, whose torch
    files are checked against their zip CRC-32 but whose safetensors carry no checksum).
    """

    path: str
    kind: str  # folder.FILES, folder.STOCK or folder.CORE
    files: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0  # bytes read by fastckpt's readers (the model's tensors and the checked files)
    seconds: float = 0.0  # the whole load_state call
    verified: bool = True


class FolderReader:
    """The reading side of one ``load_state`` of the local ``folder``; ``records``: the manifest's ``files``
    (name -> size, CRC32C), or None for a folder stock Accelerate wrote."""

    def __init__(self, folder: str, kind: str, records: dict[str, dict[str, int]] | None, *, workers: int,
                 verify: bool) -> None:
        self.folder = folder
        self.records = records
        self.workers = max(1, workers)
        self.verify = verify
        self.storage = LocalStorage(folder)
        self.stats = LoadStateStats(folder, kind, verified=verify and records is not None)
        self._models_read: list[str] = []  # weight files already read into their models (named in errors)
        self._buffers: dict[str, tuple[mmap.mmap, torch.UntypedStorage]] = {}  # read torch files, until loaded
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ before stock load_state runs

    def precheck(self) -> None:
        """Read every torch file (all but the model's safetensors, read into the parameters as they are checked)
        into memory of its own, checking it as it arrives, before anything is loaded; ``IntegrityError`` names the
        first damaged file."""
        names = sorted(self.records) if self.records is not None else sorted(
            n for n in os.listdir(self.folder) if os.path.isfile(os.path.join(self.folder, n)))
        todo: list[tuple[str, str, int, dict[str, int] | None]] = []
        for name in names:
            if name.endswith(".safetensors"):
                continue
            path = os.path.join(self.folder, name)
            record = self.records.get(name) if self.records is not None else None
            size = _size(path, record)
            with open(path, "rb") as f:
                zipped = is_zip(f.read(4))
            if zipped:
                todo.append((name, path, size, record))
            elif record is not None and self.verify:  # an old (non-zip) torch file: checked, then stock reads it
                _check_crc32c(path, size, record["crc32c"], self.workers)
        prefetch(self.storage, [t[1] for t in todo])  # queue every file's readahead at once
        ranges: list[Range] = []
        buffers: dict[str, tuple[mmap.mmap, memoryview]] = {}
        for name, path, size, _ in todo:
            # Anonymous memory, the loaded tensors' own. Populated by the kernel in one go: faulting 1 GB in page
            # by page during the reads took 0.64-1.1 s on the benchmark VM, populating it first 0.38-0.52 s all told.
            buf = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
            view = memoryview(buf)[:size]
            buffers[name] = (buf, view)
            ranges += [Range(path, start, view[start:start + PIECE_BYTES]) for start in range(0, size, PIECE_BYTES)]
        crcs = self._read(ranges, checksum=self.verify and self.records is not None)
        for name, path, size, record in todo:
            buf, view = buffers[name]
            if record is not None and self.verify:
                got = _combined([r for r in ranges if r.path == path], crcs)
                if got != record["crc32c"]:
                    raise IntegrityError(f"{path}: checksum mismatch (CRC32C {got:#010x}, the manifest says "
                                         f"{record['crc32c']:#010x}); the file is damaged, nothing was loaded: load "
                                         "an older checkpoint with accelerator.load_state(<path>)")
            elif self.verify:
                # (name, offset, size, crc) of every record, from the bytes in memory; raises on a malformed zip
                spans = [span for span in record_spans(path, view) if span[2]]
                check_records(path, view, spans, self.workers,
                              advice="the file is damaged, nothing was loaded: load an older checkpoint")
            self._buffers[name] = (buf, torch.frombuffer(buf, dtype=torch.uint8, count=size).untyped_storage()
                                   if size else torch.UntypedStorage(0))
            view.release()

    def _read(self, ranges: list[Range], checksum: bool) -> dict[int, int]:
        """Read ``ranges`` on the worker threads; with ``checksum``, each one's CRC32C (by ``id``), taken by the
        thread that read it right after it arrived, while it is hot in cache."""
        crcs: dict[int, int] = {}

        def arrived(r: Range) -> None:
            crcs[id(r)] = crc32c(r.out)

        nbytes = read_ranges(self.storage, ranges, self.workers, arrived if checksum else None)
        with self._lock:
            self.stats.nbytes += nbytes
        return crcs

    # ------------------------------------------------------------------ replacing Accelerate's readers

    def load_with(self, load: Callable[..., Any], f: Any, map_location: Any = None, *,
                  extra_globals: tuple[Any, ...] = (), **kwargs: Any) -> Any:
        """``load(f, map_location, **kwargs)`` (``torch.load``, or Accelerate's wrapper of it, which allows
        ``extra_globals`` in weights-only unpickling): from the file's bytes read by ``precheck``."""
        name = os.path.basename(os.fspath(f))
        same_folder = os.path.dirname(os.path.abspath(os.fspath(f))) == os.path.abspath(self.folder)
        with self._lock:
            held = self._buffers.pop(name, None) if same_folder and set(kwargs) <= {"weights_only"} else None
        if held is None:
            self._note(name, "stock", "not read beforehand, or load arguments fastckpt leaves to torch.load")
            return load(f, map_location=map_location, **kwargs)
        self._note(name, "read")
        buf, storage = held
        weights_only = kwargs.get("weights_only", True)
        with _allowed_globals(extra_globals if weights_only else ()):
            # torch.load(weights_only=...)'s own loader, given the bytes (as torch.load(mmap=True) is given a mapping)
            return torch.serialization._load(torch._C.PyTorchFileReader(buf), map_location,
                                             torch._weights_only_unpickler if weights_only else pickle,
                                             overall_storage=storage, encoding="utf-8")

    def load_model(self, original: Callable[..., Any], model: nn.Module, filename: Any, strict: bool = True,
                   device: str | int = "cpu", **kwargs: Any) -> tuple[Any, list[str]]:
        """safetensors' ``load_model(model, filename, strict, device)``: into the model's tensors when it can."""
        path = os.fspath(filename)
        name = os.path.basename(path)
        record = self.records.get(name) if self.records is not None else None
        if self.records is not None and record is None:
            self._note(name, "stock", "not listed in the manifest")
            return original(model, filename, strict=strict, device=device, **kwargs)
        size = _size(path, record)
        earlier = (f"; {', '.join(self._models_read)} had already been read into their models"
                   if self._models_read else "")
        plan, why = _plan_model(model, path, size, str(device), strict, kwargs)
        if plan is None:
            if record is not None and self.verify:  # stock's errors, on checked bytes
                _check_crc32c(path, size, record["crc32c"], self.workers, earlier)
            self._note(name, "stock", why)
            result = original(model, filename, strict=strict, device=device, **kwargs)
            self._models_read.append(name)
            return result
        crc = self._read_into(path, plan, record["crc32c"] if record is not None and self.verify else None)
        self._models_read.append(name)
        if crc is not None and crc != record["crc32c"]:
            raise IntegrityError(
                f"{path}: checksum mismatch (CRC32C {crc:#010x}, the manifest says {record['crc32c']:#010x}); the "
                "file is damaged. Its tensors were read into the model as they were checked, so the model now holds "
                f"the file's (damaged) values{earlier}; nothing else (optimizer, scheduler, RNG, ...) was loaded. "
                "Load an older checkpoint with accelerator.load_state(<path>) before training on")
        self._note(name, "into")
        return plan.missing, plan.unexpected

    def _read_into(self, path: str, plan: "_ModelPlan", want: int | None) -> int | None:
        """Read every range of ``plan``; the file's CRC32C (header and ranges combined) when ``want`` is set."""
        chunks = [Range(path, offset + start, out[start:start + PIECE_BYTES])
                  for offset, out in plan.ranges for start in range(0, len(out), PIECE_BYTES)]
        prefetch(self.storage, [path])
        crcs = self._read(chunks, checksum=want is not None)
        with self._lock:
            self.stats.nbytes += len(plan.header)
        return None if want is None else _combined(chunks, crcs, crc32c(plan.header))

    def _note(self, name: str, how: str, why: str = "") -> None:
        with self._lock:
            self.stats.files[name] = how
            if why:
                self.stats.fallbacks[name] = why


@dataclass
class _ModelPlan:
    """Where each byte of a safetensors file lands: the header, then (file offset, memory) ranges that cover the
    rest of the file exactly; what stock ``load_model`` would return."""

    header: bytes
    ranges: list[tuple[int, memoryview]]
    keep: list[torch.Tensor]  # scratch tensors the ranges write into (file keys the model lacks)
    missing: set[str]
    unexpected: list[str]


def _plan_model(model: nn.Module, path: str, size: int, device: str, strict: bool,
                kwargs: dict[str, Any]) -> tuple[_ModelPlan | None, str]:
    """The plan to read ``path`` into ``model``, or (None, why stock must read it)."""
    if kwargs or device != "cpu":
        return None, f"load_model arguments {sorted(kwargs)} / device {device!r}: stock reads it"
    for m in model.modules():
        if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
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
    return _ModelPlan(header, ranges, keep, missing, unexpected), ""


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


def _size(path: str, record: dict[str, int] | None) -> int:
    """The file's size; ``IntegrityError`` naming it when it is missing or differs from its manifest record."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError as e:
        raise IntegrityError(f"{path}: listed in the manifest but missing; the checkpoint is damaged, nothing was "
                             "loaded: load an older one with accelerator.load_state(<path>)") from e
    if record is not None and size != record["size"]:
        raise IntegrityError(f"{path}: {size} bytes, the manifest says {record['size']} (truncated or overwritten); "
                             "nothing was loaded: load an older checkpoint with accelerator.load_state(<path>)")
    return size


def _combined(ranges: list[Range], crcs: dict[int, int], start: int = 0) -> int:
    """The CRC32C of the bytes of ``ranges`` in file order (contiguous), after ``start``'s bytes."""
    total = start
    for r in sorted(ranges, key=lambda r: r.offset):
        total = combine(total, crcs[id(r)], len(r.out))
    return total


@contextmanager
def _allowed_globals(extra: tuple[Any, ...]) -> Iterator[None]:
    """``extra`` allowed in weights-only unpickling for the block, as Accelerate's ``load`` allows its own."""
    if not extra:
        yield
        return
    old = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals(list(extra))
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        if old:
            torch.serialization.add_safe_globals(old)


def _check_crc32c(path: str, size: int, want: int, workers: int, earlier: str = "") -> None:
    """The file's CRC32C from pieces checked on ``workers`` threads over a read-only mapping (their page faults
    are the parallel reads, crc32c releases the GIL), combined; ``IntegrityError`` naming the file."""
    if size == 0:
        got = 0
    else:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                if len(view) != size:
                    raise IntegrityError(f"{path}: {len(view)} bytes, the manifest says {size}")
                starts = list(range(0, size, PIECE_BYTES))
                with ThreadPoolExecutor(min(workers, len(starts)), thread_name_prefix="fastckpt-accel-check") as pool:
                    values = list(pool.map(lambda s: crc32c(view[s:s + PIECE_BYTES]), starts))
            finally:
                view.release()
        got = values[0]
        for s, v in zip(starts[1:], values[1:]):
            got = combine(got, v, min(PIECE_BYTES, size - s))
    if got != want:
        loaded = f"nothing else was loaded{earlier}" if earlier else "nothing was loaded"
        raise IntegrityError(f"{path}: checksum mismatch (CRC32C {got:#010x}, the manifest says {want:#010x}); "
                             f"the file is damaged, {loaded}: load an older checkpoint with "
                             "accelerator.load_state(<path>)")
