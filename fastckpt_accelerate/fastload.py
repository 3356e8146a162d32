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
CRC-32 once read; a safetensors file has no checksum. Only the files ``load_state`` reads are read and checked
(``loadstats.stock_reads``; anything else it asks for is read and checked when it asks): an unrelated damaged file
beside them does not block a load stock Accelerate performs. Every torch file is unpickled by ``load_zip_buffer``,
never more lenient than ``torch.load``: each storage must be exactly its record. ``last_load_stats.checked`` says
what each file read was checked against, and ``verified`` is True only if that was the manifest for every one.
"""
from __future__ import annotations

import logging
import mmap
import os
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import nn

from fastckpt import LocalStorage
from fastckpt.format.checksum import combine, crc32c
from fastckpt.format.picklecheck import allowing
from fastckpt.errors import IntegrityError
from fastckpt.read.readers import PIECE_BYTES, Range, prefetch, read_ranges
from fastckpt.format.torchfile import is_zip, record_spans
from fastckpt.read.torchzip import check_records, load_zip_buffer

from .loadstats import MANIFEST_CHECKED, NOT_CHECKED, ZIP_CHECKED, LoadStateStats, stock_reads
from .modelplan import ModelPlan, plan_model

__all__ = ["FolderReader", "LoadStateStats"]
log = logging.getLogger("fastckpt")

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: allocate a mapping's pages when it is made


class FolderReader:
    """The reading side of one ``load_state`` of the local ``folder``; ``records``: the manifest's ``files``
    (name -> size, CRC32C), or None for a folder stock Accelerate wrote; ``process_index``: this process's (the one
    RNG file of a stock folder it reads)."""

    def __init__(self, folder: str, kind: str, records: dict[str, dict[str, int]] | None, *, workers: int,
                 verify: bool, process_index: int | None = None) -> None:
        self.folder = folder
        self.records = records
        self.workers = max(1, workers)
        self.verify = verify
        self.process_index = process_index
        self.storage = LocalStorage(folder)
        self.stats = LoadStateStats(folder, kind, verified=verify and records is not None)
        self._models_read: list[str] = []  # weight files already read into their models (named in errors)
        self._buffers: dict[str, tuple[mmap.mmap, list[tuple[str, int, int, int]]]] = {}  # read torch files, spans
        self._checked: dict[str, str] = {}  # what each file read or checked so far was checked against
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ before stock load_state runs

    def precheck(self) -> None:
        """Read the torch files load_state reads (all but the model's safetensors, read into the parameters as they
        are checked) into memory of their own, checking each as it arrives, before anything is loaded;
        ``IntegrityError`` names the first damaged file. A native folder's are the files its manifest lists (a
        damaged one is a damaged checkpoint); a stock folder's, those Accelerate's ``load_state`` reads
        (``stock_reads``): an unrelated file beside them is no business of this load."""
        names = sorted(self.records) if self.records is not None else sorted(
            n for n in os.listdir(self.folder)
            if stock_reads(n, self.process_index) and os.path.isfile(os.path.join(self.folder, n)))
        self._read_files([n for n in names if not n.endswith(".safetensors")])

    def _read_files(self, names: list[str]) -> None:
        """Read the torch zip files ``names`` whole, in parallel pieces, checking them (against the manifest where it
        lists them, else against their zip CRC-32s); a non-zip one is checked here where the manifest lists it, and
        left to stock's reading."""
        todo: list[tuple[str, str, int, dict[str, int] | None]] = []
        for name in names:
            path = os.path.join(self.folder, name)
            record = self.records.get(name) if self.records is not None else None
            size = _size(path, record)
            with open(path, "rb") as f:
                zipped = is_zip(f.read(4))
            if zipped:
                todo.append((name, path, size, record))
            elif record is not None and self.verify:  # an old (non-zip) torch file: checked, then stock reads it
                _check_crc32c(path, size, record["crc32c"], self.workers)
                self._checked[name] = MANIFEST_CHECKED
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
        crcs = self._read(ranges, checksum=self.verify and any(t[3] is not None for t in todo))
        for name, path, size, record in todo:
            buf, view = buffers[name]
            try:
                checked = NOT_CHECKED
                if record is not None and self.verify:
                    got = _combined([r for r in ranges if r.path == path], crcs)
                    if got != record["crc32c"]:
                        raise IntegrityError(f"{path}: checksum mismatch (CRC32C {got:#010x}, the manifest says "
                                             f"{record['crc32c']:#010x}); the file is damaged, nothing was loaded: "
                                             "load an older checkpoint with accelerator.load_state(<path>)")
                    checked = MANIFEST_CHECKED
                # (name, offset, size, crc) of every record, from the bytes in memory; IntegrityError naming the file
                # on a malformed zip. Needed even unchecked: each storage loaded must be exactly its record.
                spans = record_spans(path, view)
                if record is None and self.verify and check_records(
                        path, view, spans, self.workers,
                        advice="the file is damaged, nothing was loaded: load an older checkpoint"):
                    checked = ZIP_CHECKED
            finally:
                view.release()
            with self._lock:
                self._buffers[name] = (buf, spans)
                self._checked[name] = checked

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
        ``extra_globals`` in weights-only unpickling): from the file's bytes read by ``precheck``, or read and
        checked now (a file precheck did not expect: one the manifest does not list, or an unusual name)."""
        path = os.fspath(f)
        name = os.path.basename(path)
        same_folder = os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.folder)
        ours = same_folder and set(kwargs) <= {"weights_only"}
        with self._lock:
            held = self._buffers.pop(name, None) if ours else None
        if held is None and ours and name not in self._checked and os.path.isfile(path):
            if self.records is not None and name not in self.records:
                log.warning("%s: not listed in the manifest of %s (no file of the save fastckpt committed): loaded "
                            "after a check of its own zip CRC-32s only; last_load_stats.verified is False", path,
                            self.folder)
            self._read_files([name])
            with self._lock:
                held = self._buffers.pop(name, None)
        if held is None:
            self._note(name, "stock", "not read beforehand, or load arguments fastckpt leaves to torch.load",
                       self._checked.get(name, NOT_CHECKED) if same_folder else NOT_CHECKED)
            with allowing(extra_globals if kwargs.get("weights_only", True) else ()):
                return load(f, map_location=map_location, **kwargs)
        self._note(name, "read", checked=self._checked[name])
        buf, spans = held
        weights_only = kwargs.get("weights_only", True)
        with allowing(extra_globals if weights_only else ()):
            # torch.load(weights_only=...)'s own loader over the checked bytes, each storage exactly its record
            return load_zip_buffer(path, buf, spans, map_location=map_location,
                                   pickle_module=torch._weights_only_unpickler if weights_only else pickle)

    def load_model(self, original: Callable[..., Any], model: nn.Module, filename: Any, strict: bool = True,
                   device: str | int = "cpu", **kwargs: Any) -> tuple[Any, list[str]]:
        """safetensors' ``load_model(model, filename, strict, device)``: into the model's tensors when it can."""
        path = os.fspath(filename)
        name = os.path.basename(path)
        record = self.records.get(name) if self.records is not None else None
        if self.records is not None and record is None:
            log.warning("%s: not listed in the manifest of %s (no file of the save fastckpt committed): read by "
                        "stock, unchecked; last_load_stats.verified is False", path, self.folder)
            self._note(name, "stock", "not listed in the manifest", NOT_CHECKED)
            return original(model, filename, strict=strict, device=device, **kwargs)
        size = _size(path, record)
        earlier = (f"; {', '.join(self._models_read)} had already been read into their models"
                   if self._models_read else "")
        plan, why = plan_model(model, path, size, str(device), strict, kwargs)
        checked = MANIFEST_CHECKED if record is not None and self.verify else NOT_CHECKED  # safetensors: no CRCs
        if plan is None:
            if checked == MANIFEST_CHECKED:  # stock's errors, on checked bytes
                _check_crc32c(path, size, record["crc32c"], self.workers, earlier)
            self._note(name, "stock", why, checked)
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
        self._note(name, "into", checked=checked)
        return plan.missing, plan.unexpected

    def _read_into(self, path: str, plan: "ModelPlan", want: int | None) -> int | None:
        """Read every range of ``plan``; the file's CRC32C (header and ranges combined) when ``want`` is set."""
        chunks = [Range(path, offset + start, out[start:start + PIECE_BYTES])
                  for offset, out in plan.ranges for start in range(0, len(out), PIECE_BYTES)]
        prefetch(self.storage, [path])
        crcs = self._read(chunks, checksum=want is not None)
        with self._lock:
            self.stats.nbytes += len(plan.header)
        return None if want is None else _combined(chunks, crcs, crc32c(plan.header))

    def _note(self, name: str, how: str, why: str = "", checked: str = NOT_CHECKED) -> None:
        """``name`` was read ``how`` (and why not fast), its bytes checked against ``checked``: ``verified`` holds
        only while every file read was checked against the manifest."""
        with self._lock:
            self.stats.files[name] = how
            self.stats.checked[name] = checked
            if checked != MANIFEST_CHECKED:
                self.stats.verified = False
            if why:
                self.stats.fallbacks[name] = why


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
