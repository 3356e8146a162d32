"""Read a checkpoint folder fast under Accelerate's own ``load_state``: the model straight into its parameters,
the torch files mapped, every byte checked as it is read (one pass, no verification pass before the load).

Stock ``load_state`` stays in charge of *what* is restored and in which order (load pre-hooks, ``map_location``,
``strict``, optimizers, schedulers, samplers, the scaler, RNG states, ``step``, custom objects); only the two
functions it reads files with are replaced for the duration of the call (``foreign.load_accelerate_folder``):

- ``accelerate.checkpointing.load_model`` (safetensors' ``load_model``), for ``model.safetensors``: the header is
  parsed, each tensor's byte range is read (``fastckpt.readers.read_ranges``: parallel ``preadv``) into the
  storage of the parameter or buffer it belongs to, each piece's CRC32C is taken by the thread that read it, and
  the pieces' values are combined (``fastckpt.checksum.combine``) with the header's into the file's CRC32C, which
  the manifest lists. Where the model is not a plain CPU module that takes the file as it is (a key, shape or
  dtype mismatch, tied weights stored twice, load_state_dict hooks, a custom ``_load_from_state_dict``, CUDA
  tensors, a file layout with holes) the file is checked by a mapped pass and stock ``load_model`` reads it: its
  errors are stock's, and ``strict=False`` returns what stock returns.
- ``accelerate.checkpointing.load`` (``torch.load`` with Accelerate's safe globals), for ``optimizer.bin``,
  ``scheduler.bin``, ``random_states_N.pkl``, ...: the file was checked (``precheck``) by a pass over a
  read-only mapping on a few threads (their page faults are the parallel reads), and ``torch.load(mmap=True)``
  then maps it (copy-on-write, as ``torch.load(mmap=True)`` always does: the loaded tensors are views of the page
  cache until written, and a write never reaches the file; the files are replaced by a rename, never truncated
  in place, so the mapping stays valid).

``precheck`` runs before stock ``load_state`` touches anything: every listed file except the model's safetensors
is checked against the manifest then (the optimizer's bytes are read once, into the page cache, where the later
mapping finds them). A damaged file is an ``IntegrityError`` naming it before the model is written. The one
exception is ``model.safetensors`` itself: its bytes land in the parameters as they are checked, so a damaged
file is detected after every one of its tensors was written: the model then holds the file's (damaged) values,
nothing else (optimizer, scheduler, RNG, ...) was loaded, and the error says so.

A stock folder (no manifest) gets what its format offers: the torch files' zip records are checked against their
CRC-32 (the same mapped pass); a safetensors file has no checksum.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase  # torch's BatchNorm base: its loader is checked below

from fastckpt.checksum import combine, crc32c
from fastckpt.errors import IntegrityError
from fastckpt.plan import st_dtype
from fastckpt.readers import PIECE_BYTES, Range, prefetch, read_ranges, tensor_bytes
from fastckpt.storage import LocalStorage
from fastckpt.torchfile import is_zip, record_spans

try:  # torch records' CRC-32 at crc32c speed (as fastckpt.torchfile); both release the GIL
    from zlib_ng.zlib_ng import crc32 as _zip_crc32
except ImportError:  # pragma: no cover - depends on the environment
    _zip_crc32 = zlib.crc32

__all__ = ["FolderReader", "LoadStateStats"]

_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
# Modules whose _load_from_state_dict is nn.Module's, or differs only for old files lacking a key (BatchNorm's
# num_batches_tracked): for them, writing the file's bytes into the tensors is what load_state_dict does.
_PLAIN_LOADERS = (nn.Module._load_from_state_dict, _NormBase._load_from_state_dict)


@dataclass
class LoadStateStats:
    """What one ``load_state`` did: ``FastAccelerateCheckpointing.last_load_stats``.

    ``files`` maps each file read to how: ``"into"`` (read straight into the model's tensors), ``"map"``
    (checked, then mapped by ``torch.load(mmap=True)``), ``"stock"`` (read by Accelerate's own code after a
    check, when ``checked``), ``"core"`` (the pre-native core layout). ``fallbacks``: why a file did not take
    the fast path. ``verified``: every byte read was checked against the manifest (or, in a stock folder, the
    torch files against their zip CRC-32).
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
        self.stats = LoadStateStats(folder, kind, verified=verify)
        self._checked: set[str] = set()  # files whose bytes were checked (and are in the page cache)
        self._zips: set[str] = set()  # of those, the ones torch.load can map (zip format)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ before stock load_state runs

    def precheck(self) -> None:
        """Check every file but the model's safetensors (read into the parameters as it is checked) before
        anything is loaded; ``IntegrityError`` names the first damaged file."""
        names = sorted(self.records) if self.records is not None else sorted(
            n for n in os.listdir(self.folder) if os.path.isfile(os.path.join(self.folder, n)))
        names = [n for n in names if not n.endswith(".safetensors")]
        prefetch(self.storage, [os.path.join(self.folder, n) for n in names])  # queue every file's readahead
        for name in names:
            self._check_file(name)

    def _check_file(self, name: str) -> None:
        path = os.path.join(self.folder, name)
        record = self.records.get(name) if self.records is not None else None
        if self.records is not None and record is None:
            return  # not listed: stock reads it unchecked, as it would
        try:
            size = os.path.getsize(path)
        except FileNotFoundError as e:
            if record is None:
                return
            raise IntegrityError(f"{path}: listed in the manifest but missing; the checkpoint is damaged: load an "
                                 "older one with accelerator.load_state(<path>)") from e
        with open(path, "rb") as f:
            head = f.read(4)
        if record is not None:
            if size != record["size"]:
                raise IntegrityError(f"{path}: {size} bytes, the manifest says {record['size']} (truncated or "
                                     "overwritten); load an older checkpoint with accelerator.load_state(<path>)")
            if self.verify:
                _check_crc32c(path, size, record["crc32c"], self.workers)
        elif self.verify and is_zip(head):
            _check_zip_records(path, self.workers)
        else:
            return  # a stock non-zip file (an old torch format): stock reads it as it is
        with self._lock:
            self._checked.add(name)
            if is_zip(head):
                self._zips.add(name)
            self.stats.nbytes += size

    # ------------------------------------------------------------------ replacing Accelerate's readers

    def load_with(self, load: Callable[..., Any], f: Any, *args: Any, **kwargs: Any) -> Any:
        """``load(f, ...)`` (``torch.load`` or Accelerate's wrapper), mapped once the file was checked."""
        name = os.path.basename(os.fspath(f))
        if os.path.dirname(os.path.abspath(os.fspath(f))) != os.path.abspath(self.folder) or name not in self._zips \
                or "mmap" in kwargs:
            self._note(name, "stock", "not checked beforehand" if name not in self._checked else "")
            return load(f, *args, **kwargs)
        self._note(name, "map")
        return load(f, *args, mmap=True, **kwargs)

    def load_model(self, original: Callable[..., Any], model: nn.Module, filename: Any, strict: bool = True,
                   device: str | int = "cpu", **kwargs: Any) -> tuple[Any, list[str]]:
        """safetensors' ``load_model(model, filename, strict, device)``: into the model's tensors when it can."""
        path = os.fspath(filename)
        name = os.path.basename(path)
        record = self.records.get(name) if self.records is not None else None
        if self.records is not None and record is None:
            self._note(name, "stock", "not listed in the manifest")
            return original(model, filename, strict=strict, device=device, **kwargs)
        size = os.path.getsize(path)
        if record is not None and size != record["size"]:
            raise IntegrityError(f"{path}: {size} bytes, the manifest says {record['size']} (truncated or "
                                 "overwritten); nothing was loaded. Load an older checkpoint with "
                                 "accelerator.load_state(<path>)")
        plan, why = _plan_model(model, path, size, str(device), strict, kwargs)
        if plan is None:
            if record is not None and self.verify:
                _check_crc32c(path, size, record["crc32c"], self.workers)  # stock's errors, on checked bytes
            self._note(name, "stock", why)
            return original(model, filename, strict=strict, device=device, **kwargs)
        crc = self._read_into(path, plan, record["crc32c"] if record is not None and self.verify else None)
        if crc is not None and crc != record["crc32c"]:
            raise IntegrityError(
                f"{path}: checksum mismatch (CRC32C {crc:#010x}, the manifest says {record['crc32c']:#010x}); the "
                "file is damaged. Its tensors were read into the model as they were checked, so the model now holds "
                "the file's (damaged) values; nothing else (optimizer, scheduler, RNG, ...) was loaded. Load an "
                "older checkpoint with accelerator.load_state(<path>) before training on")
        self._note(name, "into")
        return plan.missing, plan.unexpected

    def _read_into(self, path: str, plan: "_ModelPlan", want: int | None) -> int | None:
        """Read every range of ``plan``; the file's CRC32C (header and ranges combined) when ``want`` is set."""
        chunks: list[Range] = []
        for offset, out in plan.ranges:
            for start in range(0, len(out), PIECE_BYTES):  # one Range per piece: on_done sees each piece
                chunks.append(Range(path, offset + start, out[start:start + PIECE_BYTES]))
        crcs: dict[int, int] = {}

        def arrived(r: Range) -> None:  # on the reading thread, right after the piece arrived (hot in cache)
            crcs[id(r)] = crc32c(r.out)

        prefetch(self.storage, [path])
        nbytes = read_ranges(self.storage, chunks, self.workers, arrived if want is not None else None)
        with self._lock:
            self.stats.nbytes += nbytes + len(plan.header)
        if want is None:
            return None
        total = crc32c(plan.header)
        for r in sorted(chunks, key=lambda r: r.offset):
            total = combine(total, crcs[id(r)], len(r.out))
        return total

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
        if start == stop:
            continue
        t = targets.get(key)
        if t is None:  # not in the model (strict=False): read it anyway, the file's CRC covers it
            t = torch.empty(stop - start, dtype=torch.uint8)
            keep.append(t)
        elif list(t.shape) != shape or st_dtype(t.dtype) != dtype or (dtype == "U8" and t.dtype != torch.uint8) \
                or t.numel() * t.element_size() != stop - start:
            return None, f"tensor {key!r}: shape/dtype differ (stock raises its error)"
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


def _check_crc32c(path: str, size: int, want: int, workers: int) -> None:
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
        raise IntegrityError(f"{path}: checksum mismatch (CRC32C {got:#010x}, the manifest says {want:#010x}); "
                             "the file is damaged, nothing was loaded: load an older checkpoint with "
                             "accelerator.load_state(<path>)")


def _check_zip_records(path: str, workers: int) -> None:
    """A stock torch file: each storage record against the CRC-32 of its zip entry, on ``workers`` threads."""
    spans = [s for s in record_spans(path) if s[2]]  # (name, offset, size, crc); raises on a malformed zip

    def one(span: tuple[str, int, int, int], view: memoryview) -> None:
        name, offset, n, want = span
        got = _zip_crc32(view[offset:offset + n]) & 0xFFFFFFFF
        if want and got != want:  # 0: written with torch's CRC option off, nothing to check against
            raise IntegrityError(f"{path}: record {name!r} has CRC-32 {got:08x}, its zip entry says {want:08x}; "
                                 "the file is damaged, nothing was loaded: load an older checkpoint")

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="fastckpt-accel-check") as pool:
                for fut in [pool.submit(one, s, view) for s in sorted(spans, key=lambda s: -s[2])]:
                    fut.result()
        finally:
            view.release()
