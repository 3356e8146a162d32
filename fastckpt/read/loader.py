"""Reading checkpoints: verify, read files in parallel, rebuild the nested state.

Every file is checked against the manifest (size, then CRC32C) before a byte of
it is used. A CRC mismatch is localised with the per-tensor checksums so the
error names the tensor as well as the file.

``load()`` on a local root maps a shard that sits in the page cache (the tensors view the cache: a
warm 1.48 GB load takes ~0.08 s) and reads one that does not (``fastckpt.read.pagecache``) as the device
reads fastest (``fastckpt.read.strategy``: O_DIRECT, parallel or sequential buffered), all such shards in
one batch into one fresh page-aligned buffer per shard, each piece's CRC32C taken as it lands; the
tensors are views of those buffers (no second copy). Mapping a cold shard instead leaves tensors that copy each 4 KiB page on the first write
of training (copy-on-write of a file mapping), so only loads whose tensors stay on the CPU read.

Measured (1.48 GB GPT-2-small + AdamW state, one fresh process per load as benchmarks/restore.py does,
page cache dropped, 5 alternating rounds on the 2-core VM shared with other jobs, load average 3-6):
torch.load median 2.66 s (1.30-5.48); this read path 1.71 s (1.38-2.37, 0.64x), then 0.03 s to write
every page once; mapping cold shards (the previous design) 1.20 s (0.76-3.15, 0.45x), then 1.65 s to
write every page once (copy-on-write). Load plus first write: 1.74 s against 2.85 s. A second run of 5
(load average ~3.5): torch.load 1.21 s (0.93-3.28), read path 1.28 s (1.13-1.55, 1.06x) + 0.01 s, mapped
1.19 s (0.67-1.92, 0.98x) + 0.95 s. In-call, the read
path loses to mapping here: the first touch of fresh anonymous memory costs ~0.7-1.1 s of CPU per 1.48
GB on this VM (torch.load pays it too), where page-cache pages are filled by the host. The 0.5x of
torch.load was not reached by the read path on this machine.

A DTensor was saved as blocks (``fastckpt.format.dtensor``): ``load`` puts them together
into one full tensor; ``load_into`` copies into each target the regions of the
blocks that overlap it, so a target DTensor of any mesh or placement gets its own
block (resharding), and on each rank only the files holding such blocks are read.
"""
from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from ..format import dtensor as dt
from ..format.checksum import crc32c
from ..format.codec import decode_tree, loads_objects
from ..errors import CheckpointNotFoundError, FastCkptError, IntegrityError, StateMismatchError
from ..format.layout import LAYOUT_FILES, MANIFEST, check_shard_header, checkpoint_dir, parse_manifest, parse_meta
from .devicecopy import DeviceCopies
from .load_into import check_targets, read_into
from .loadstats import LoadStats
from .maplocation import placer, saved_location
from .pagecache import resident_fraction
from ..format.paths import confine
from .readers import Range, prefetch
from .strategy import choose, read_whole
from ..storage.local import LocalStorage, aligned_buffer
from ..storage.protocol import Storage
from ..format.table import TableEntry, numel, parse_dtype, parse_table

__all__ = ["CheckpointReader", "ShardFile", "load_checkpoint", "is_checkpoint"]

_OWN_STORAGE_BELOW = 1 << 20  # bytes; see _materialize
_MAP_ABOVE = 0.5  # map a local shard when at least this fraction of it is in the page cache; read it otherwise


@dataclass(frozen=True, slots=True)
class ShardFile:
    """One tensor file of a checkpoint, checked against the manifest: its path (inside the checkpoint), its
    size and CRC32C as listed, and the table entries of the tensors it holds."""

    name: str
    path: str
    size: int
    crc: int
    entries: list[TableEntry]


@dataclass
class _DTensor:
    """A saved DTensor: its global shape and the table entries of its blocks, with their offsets."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    entries: list[int]
    offsets: list[tuple[int, ...]]


class CheckpointReader:
    """Reads one committed checkpoint directory."""

    def __init__(self, storage: Storage, dirpath: str, *, verify: bool = True, workers: int = 2,
                 allowed_classes: Iterable[str] = (), coord: Any = None, strategy: str = "auto", remember: bool = False) -> None:
        self.storage = storage
        self.strategy = strategy  # read.strategy (fastckpt.read.strategy); a Checkpointer's reader keeps its verdict
        self.verdict_root = getattr(storage, "url", None) if remember else None  # in its root, a lone one in memory
        self.coord = coord  # distributed: each file is read by one rank and broadcast
        self.dirpath = dirpath
        self.verify = verify
        self.workers = workers
        self.allowed = list(allowed_classes)
        mpath = storage.join(dirpath, MANIFEST)
        try:
            raw = storage.read_bytes(mpath)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(
                f"no committed checkpoint at {dirpath}: {MANIFEST} is missing (the save never "
                "committed, or the path is wrong); list committed ones with Checkpointer.list()") from e
        self.manifest = parse_manifest(raw, mpath)
        self.step: int = self.manifest["step"]
        self.name: str = self.manifest["name"]
        if self.manifest.get("layout") == LAYOUT_FILES:
            raise StateMismatchError(f"{dirpath} holds a framework's own files ({', '.join(self.manifest['files'])}), "
                                     "not a fastckpt state tree; load it with that framework (e.g. "
                                     "accelerator.load_state) or check it with `fastckpt verify`")
        meta_name = self.manifest["meta"]
        self.meta = parse_meta(self._read_small(meta_name), storage.join(dirpath, meta_name))
        # Bounds, sizes and overlaps, before anything is allocated: with verify off too.
        self.entries = parse_table(self.meta["tensors"], self.manifest["files"], storage.join(dirpath, meta_name))
        self._first_offset: dict[str, int] = {}  # per shard file: where its first tensor's bytes start
        for e in self.entries:
            if e.nbytes:
                self._first_offset[e.file] = min(e.offset, self._first_offset.get(e.file, e.offset))
        self.dtensors = self._parse_dtensors(storage.join(dirpath, meta_name))
        self._blocks = {i for d in self.dtensors for i in d.entries}
        self.stats: LoadStats | None = None  # set by each load()/load_into()
        self._maps: dict[str, bool] = {}  # per shard, this load's choice: map it (cached) or read it (cold)
        self._private = False  # this load's shard buffers become the returned CPU tensors (see _mapped)

    def _parse_dtensors(self, source: str) -> list[_DTensor]:
        """The DTensor records, checked: blocks in bounds, of the right dtype, covering the tensor exactly."""
        out = []
        try:
            for rec in self.meta.get("dtensors") or []:
                d = _DTensor(rec["key"], parse_dtype(rec["dtype"], source), tuple(rec["shape"]), [int(i) for i in rec["entries"]],
                             [tuple(int(o) for o in off) for off in rec["offsets"]])
                if (any(type(n) is not int or n < 0 for n in d.shape) or len(set(d.entries)) != len(d.entries)
                        or not all(0 <= i < len(self.entries) for i in d.entries)):
                    raise ValueError(f"shape {list(d.shape)} or block indices {d.entries[:8]} are out of range")
                covered = 0
                for i, off in zip(d.entries, d.offsets, strict=True):
                    e = self.entries[i]
                    if e.dtype != d.dtype or len(off) != len(d.shape) or any(
                            o < 0 or o + n > full for o, n, full in zip(off, e.shape, d.shape)):
                        raise ValueError(f"block {e.key!r} ({e.dtype}, {list(e.shape)} at {list(off)}) does not fit "
                                         f"{d.dtype} {list(d.shape)}")
                    covered += numel(e.shape)
                if covered != numel(d.shape):
                    raise ValueError(f"its blocks hold {covered} of its {numel(d.shape)} elements")
                out.append(d)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise IntegrityError(f"{source}: malformed DTensor record ({e}); the file is corrupt or foreign") from e
        return out

    # ---- files -------------------------------------------------------------------

    def _expect(self, name: str) -> dict[str, int]:
        rec = self.manifest["files"].get(name)
        if rec is None:
            raise IntegrityError(f"{self.dirpath}: file {name!r} is not listed in the manifest")
        return rec

    def _check_size(self, path: str, rec: dict[str, int]) -> None:
        try:
            actual = self.storage.size(path)
        except FileNotFoundError as e:
            raise IntegrityError(f"{path}: file listed in the manifest is missing; the checkpoint is damaged") from e
        if actual != rec["size"]:
            raise IntegrityError(
                f"{path}: size is {actual} bytes but the manifest says {rec['size']}; the file is truncated "
                "or was replaced. Load an earlier checkpoint (Checkpointer.list()).")

    def _path(self, name: str) -> str:
        """The path of the listed file ``name``; a symlink leading out of the checkpoint is refused."""
        return confine(self.dirpath, self.storage.join(self.dirpath, name), f"{self.dirpath}: file {name!r}")

    def _read_small(self, name: str) -> bytes:
        rec = self._expect(name)
        path = self._path(name)
        self._check_size(path, rec)
        data = self.storage.read_bytes(path)
        if self.verify and crc32c(data) != rec["crc32c"]:
            raise IntegrityError(f"{path}: checksum mismatch (CRC32C {crc32c(data):#010x}, manifest "
                                 f"{rec['crc32c']:#010x}); the file is corrupt")
        return data

    def read_plan(self) -> list[ShardFile]:
        """The tensor files in name order, each listed in the manifest, inside the checkpoint and of the listed
        size (``IntegrityError`` otherwise): what a loader reads (``load_into`` reads them into its targets)."""
        return [self._shard(name, entries) for name, entries in sorted(self._by_file().items())]

    def _shard(self, name: str, entries: list[TableEntry]) -> ShardFile:
        rec = self._expect(name)
        path = self._path(name)
        self._check_size(path, rec)
        return ShardFile(name, path, rec["size"], rec["crc32c"], entries)

    def _mapped(self, f: ShardFile) -> bool:
        """Whether this load maps ``f`` (local and mostly in the page cache) instead of reading it.

        Only a buffer whose views are returned as CPU tensors (``load()`` onto the CPU) is worth reading into
        private memory: a mapped one makes the first optimizer step copy every page it writes (copy-on-write, ~1.1-
        1.5 s for 1.48 GB on the benchmark VM). A buffer that is copied elsewhere and dropped (onto a GPU, into
        ``load_into``'s targets) is mapped, cold or not: reading it once from the page cache costs least.
        Decided once per load: the readahead that ``prefetch`` starts for a mapped shard must not turn the
        answer for a shard being read, and a shard being read must not be read twice."""
        choice = self._maps.get(f.name)
        if choice is None:
            choice = self._maps[f.name] = (getattr(self.storage, "map_file", None) is not None and f.size > 0 and (
                not self._private or resident_fraction(f.path, f.size) >= _MAP_ABOVE))
        return choice

    def _read_file(self, name: str) -> torch.Tensor:
        f = self._shard(name, [])
        if not self._mapped(f):
            return self._read_fresh([f])[name]
        # Files are immutable once written (new uid per save, deletion is unlink), so
        # mapping them is safe and skips a full copy of the checkpoint.
        keep, view = self.storage.map_file(f.path, f.size)  # type: ignore[attr-defined]
        if self.verify and crc32c(view) != f.crc:
            raise IntegrityError(f"{f.path}: checksum mismatch{self._culprit(name, view)}; the file is corrupt. "
                                 "Load an earlier checkpoint (Checkpointer.list()).")
        return self._wrap(f, keep, view)

    def _read_fresh(self, files: list[ShardFile]) -> dict[str, torch.Tensor]:
        """Read ``files`` into fresh page-aligned buffers in one batch of parallel pieces (O_DIRECT locally, queued
        across file boundaries), each piece checksummed as it arrives; a mismatch names the file and the tensor.

        Plain 4 KiB pages, faulted in by the reads themselves: on the benchmark VM populating the buffers ahead
        (MAP_POPULATE, on two threads) measured 1.6-1.9 s against 1.0-1.3 s, and transparent huge pages
        2.2-4.6 s (compaction) for a cold 1.48 GB load. A thread faulting them in just ahead of the reads
        (madvise MADV_POPULATE_WRITE, 16 MiB steps; 0.63 GB, a fresh process per load, 6-8 rounds in turns,
        2026-11-30) halved one raw buffered stream in one batch (0.89 -> 0.46 s median) and slowed the
        ``sequential`` load in another (0.64 -> 0.97 s): not kept."""
        got = {f.name: aligned_buffer(f.size) for f in files}
        read_whole(self.storage, [Range(f.path, 0, got[f.name][1], f.crc if self.verify else None, direct=True,
                                        culprit=functools.partial(self._culprit, f.name)) for f in files],
                   self.strategy, self.workers, self.verdict_root)  # a probe (read.strategy: auto) reads into them
        return {f.name: self._wrap(f, *got[f.name]) for f in files}

    def read_strategy(self, files: list[tuple[str, int]], kind: str = "fresh",
                      trial: Callable[[Sequence[str], str], str | None] | None = None) -> str:
        """How this load reads ``files`` (``(path, size)``) into destinations of ``kind``
        (``fastckpt.read.strategy.KINDS``): ``read.strategy``, or the device's verdict for that kind (probed, or
        found by ``trial``: ``fastckpt.read.strategy.choose``)."""
        return (choose(self.storage, files, self.strategy, self.workers, self.verdict_root, kind=kind, trial=trial)
                if files else "direct")

    def _wrap(self, f: ShardFile, keep: Any, view: memoryview) -> torch.Tensor:
        buf = torch.frombuffer(keep, dtype=torch.uint8)
        check_shard_header(bytes(view[:8]), len(view), self._first_offset.get(f.name), f.path)
        buf._fastckpt_keep = keep  # type: ignore[attr-defined]  # the mapping lives as long as the views
        return buf

    def _culprit(self, name: str, view: memoryview) -> str:
        for e in self.entries:
            if e.file == name and crc32c(view[e.offset: e.offset + e.nbytes]) != e.crc:
                return f" in tensor {e.key!r}"
        return " in the file header"

    def objects(self) -> list[Any]:
        """The checkpoint's non-tensor leaves (its objects file, verified, through the safe unpickler)."""
        name = self.meta.get("objects")
        if not name:
            return []
        return loads_objects(self._read_small(name), self.allowed, self.storage.join(self.dirpath, name))

    def _by_file(self) -> dict[str, list[TableEntry]]:
        files: dict[str, list[TableEntry]] = {}
        for e in self.entries:
            files.setdefault(e.file, []).append(e)
        return files

    def _for_each_file(self, fn: Callable[[torch.Tensor, list[TableEntry]], None],
                       private: set[str] | None = None) -> None:
        """Read (and verify) shard files, then hand each buffer and its entries to ``fn``.

        Every file by default (collectively, when distributed). With ``private``, files of DTensor
        blocks are read only if named there, by this rank alone (each rank needs other blocks).
        """
        files = self._by_file()
        shared = sorted(files)
        if private is not None:
            shared = [n for n in shared if not any(e.index in self._blocks for e in files[n])]
        if self.coord is not None:
            sizes = [int(self.manifest["files"][n]["size"]) for n in shared]
            buffers = self.coord.share_files(shared, sizes, self._read_file)
            for name in shared:
                fn(buffers[name], files[name])
            local = sorted(private or ())
        else:
            local = sorted(set(shared) | (private or set()))

        if isinstance(self.storage, LocalStorage) and private is None:
            # load(): every cold shard in one batch, so that the reads queue across file boundaries
            fresh = [f for f in (self._shard(n, files[n]) for n in local) if not self._mapped(f)]
            for name, buf in self._read_fresh(fresh).items():
                fn(buf, files[name])
            local = [n for n in local if self._maps.get(n)]

        def one(name: str) -> None:
            fn(self._read_file(name), files[name])

        if self.workers <= 1 or len(local) <= 1:
            for name in local:
                one(name)
            return
        with ThreadPoolExecutor(min(self.workers, len(local)), thread_name_prefix="fastckpt-load") as pool:
            for f in [pool.submit(one, n) for n in local]:
                f.result()

    # ---- public ------------------------------------------------------------------

    def load(self, map_location: Any = None) -> Any:
        """Rebuild the saved tree. Tensors land on ``map_location`` (default: CPU; see fastckpt.read.maplocation)."""
        place = placer(map_location)  # on this thread: "cuda" is the caller's current device
        t0 = time.perf_counter()
        objects = self.objects()
        tensors: list[Any] = [None] * len(self.entries)

        def read(buf: torch.Tensor, entries: list[TableEntry]) -> None:
            for e in entries:
                tensors[e.index] = self._materialize(buf, e, None)

        self._maps = {}
        self._private = _stays_on_cpu(map_location)
        if self.coord is None:  # distributed: each rank reads only some files (the others are broadcast)
            prefetch(self.storage, [f.path for f in self.read_plan() if self._mapped(f)])
        self._for_each_file(read)
        for e in self.entries:
            if e.nbytes == 0:
                tensors[e.index] = self._materialize(None, e, None)
        if place is not None:  # here, not in the read threads: a callable runs on the caller's thread
            source = self.storage.join(self.dirpath, self.manifest["meta"])
            for e in self.entries:
                if not e.numpy:
                    tensors[e.index] = place(tensors[e.index], saved_location(self.meta["tensors"][e.index], source))
        for d in self.dtensors:  # the tree refers to a DTensor by its first block: put the whole there
            blocks = [tensors[i] for i in d.entries]
            full = torch.empty(d.shape, dtype=d.dtype, device=blocks[0].device)
            for block, off in zip(blocks, d.offsets):
                full[_region(off, block.shape)] = block
            tensors[d.entries[0]] = full
        out = self.decode(tensors, objects)
        mapped = set(self._maps.values())
        self._note("map" if mapped == {True} else "read" if True not in mapped else "map+read", t0)
        return out

    def _note(self, method: str, t0: float, nbytes: int | None = None) -> None:
        tier = "local" if isinstance(self.storage, LocalStorage) else "remote"
        total = sum(e.nbytes for e in self.entries) if nbytes is None else nbytes
        self.stats = LoadStats(self.name, self.step, tier, method, total, time.perf_counter() - t0, self.verify)

    def check_structure(self) -> None:
        """Rebuild the tree around placeholders, reading no tensor bytes; ``fastckpt verify`` calls this."""
        self.decode([None] * len(self.entries), self.objects())

    def decode(self, tensors: list[Any], objects: list[Any]) -> Any:
        """Rebuild the saved tree around ``tensors`` (one per table entry) and ``objects``; a malformed tree (a
        crafted meta file) is an IntegrityError naming the file."""
        try:
            return decode_tree(self.meta["tree"], tensors, objects)
        except FastCkptError:
            raise
        except (ValueError, KeyError, IndexError, TypeError, RuntimeError, RecursionError) as e:
            # RuntimeError: torch.device("crafted"); RecursionError is one too, named for clarity.
            raise IntegrityError(f"{self.storage.join(self.dirpath, self.manifest['meta'])}: malformed tree "
                                 f"({type(e).__name__}: {str(e)[:200]}); the file is corrupt or crafted") from e

    def _materialize(self, buf: torch.Tensor | None, e: TableEntry, map_location: Any) -> Any:
        if buf is None or e.nbytes == 0:
            t = torch.empty(e.shape, dtype=e.dtype)
        else:
            raw = buf[e.offset: e.offset + e.nbytes]
            if e.offset % max(e.dtype.itemsize, 1) or e.nbytes <= _OWN_STORAGE_BELOW:
                # Small tensors (RNG states, step counters, scalars) get storage of their own:
                # torch.set_rng_state and Generator.set_state ignore storage offsets, and a
                # foreign layout may be misaligned. Large ones stay zero-copy views.
                raw = raw.clone()
            t = raw.view(e.dtype).view(e.shape)
        if e.numpy:
            return t.numpy()
        if map_location is not None:
            t = placer(map_location)(t, saved_location(self.meta["tensors"][e.index], self.dirpath))  # type: ignore[misc]
        return t

    def load_into(self, target: Any) -> Any:
        """Copy saved tensors into ``target``'s tensors in place (matched by tree path).

        Every tensor of ``target`` must exist in the checkpoint with the same dtype and shape.
        Checkpoint tensors that ``target`` lacks (say, optimizer state before the first step)
        are loaded into new tensors. Returns the saved tree built on ``target``'s tensors.
        """
        from ..format.plan import flatten

        t0 = time.perf_counter()
        self._maps = {}
        self._private = False  # whole files are read only to be copied into the targets
        if not self.dtensors and self.coord is None:  # plain tensors: read straight into the target
            done = read_into(self, target)
            if done is not None:
                self._note("into", t0, done[1])
                return done[0]
        flat = flatten(target)
        block_keys = {flat.keys[i] for rec in flat.dtensors for i in rec.entries}
        wanted: dict[str, Any] = {k: t for k, t in zip(flat.keys, flat.tensors) if k not in block_keys}
        wanted.update((rec.key, rec.tensor) for rec in flat.dtensors)  # DTensor targets, by their own key
        saved: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            e.key: (e.dtype, e.shape) for e in self.entries if e.index not in self._blocks}
        saved.update((d.key, (d.dtype, d.shape)) for d in self.dtensors)
        check_targets(self.dirpath, wanted, saved)
        # Where each saved tensor goes: (target, region of the target's own data it covers, in global offsets).
        # A plain saved tensor is one block at offset 0; a DTensor target holds only its local block.
        regions = {key: dt.local_region(t) for key, t in wanted.items()}
        place: dict[int, tuple[str, tuple[int, ...]]] = {}
        for e in self.entries:
            if e.index not in self._blocks:
                place[e.index] = (e.key, (0,) * len(e.shape))
        for d in self.dtensors:
            for i, off in zip(d.entries, d.offsets):
                place[i] = (d.key, off)
        private = {self.entries[i].file for d in self.dtensors for i, off in zip(d.entries, d.offsets)
                   if d.key not in wanted or dt.overlap(off, self.entries[i].shape, *regions[d.key]) is not None}
        objects = self.objects()
        out: list[Any] = [None] * len(self.entries)
        saved_dt = {d.key: d for d in self.dtensors}
        fresh: dict[str, torch.Tensor] = {}  # DTensors the target lacks: loaded whole
        fresh_lock = threading.Lock()  # files are read on several threads
        local_of = {key: t._local_tensor if dt.is_dtensor(t) else t for key, t in wanted.items()}  # what it holds

        def read(buf: torch.Tensor, entries: list[TableEntry]) -> None:
            for e in entries:
                src = self._materialize(buf, e, None)
                key, off = place[e.index]
                dst = wanted.get(key)
                if dst is None:
                    if e.index in self._blocks:
                        d = saved_dt[key]
                        with fresh_lock:
                            full = fresh.setdefault(key, torch.empty(d.shape, dtype=d.dtype))
                        full[_region(off, e.shape)] = src
                    else:
                        out[e.index] = src
                    continue
                if e.numpy:
                    src = torch.from_numpy(src)
                hit = dt.overlap(off, e.shape, *regions[key])
                if hit is not None:  # into CUDA: staged, then on the device's side stream, after the caller's work
                    device.copy(local_of[key][hit[1]], src[hit[0]])

        device = DeviceCopies()
        device.prepare(t.device.index for t in local_of.values() if t.is_cuda)
        try:
            self._for_each_file(read, private if self.dtensors else None)
        finally:
            device.drain()  # a failed load too: no pinned source is let go while a copy may still read it
            device.finish()
        for e in self.entries:
            key, _ = place[e.index]
            if key in wanted:
                dst = wanted[key]
                out[e.index] = dst.numpy() if e.numpy else dst
            elif out[e.index] is None and e.index not in self._blocks:  # zero-size tensors live in no file
                out[e.index] = self._materialize(None, e, None)
        for key, full in fresh.items():
            out[saved_dt[key].entries[0]] = full
        tree = self.decode(out, objects)
        self._note("into", t0)
        return tree


def _stays_on_cpu(map_location: Any) -> bool:
    """Whether ``load(map_location)`` returns CPU tensors (views of the read buffers); False only for a device."""
    if isinstance(map_location, (str, torch.device)):
        try:
            return torch.device(map_location).type == "cpu"
        except (TypeError, RuntimeError):
            return True  # placer() reports the bad value
    return True


def _region(offsets: tuple[int, ...], shape: Any) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, shape))


def load_checkpoint(path: str, *, map_location: Any = None, storage_options: dict | None = None,
                    verify: bool = True, allowed_classes: Iterable[str] = ()) -> Any:
    """Load one checkpoint directory (local path or URL) without a Checkpointer."""
    from ..storage.protocol import open_storage

    storage = open_storage(checkpoint_dir(path), storage_options)
    return CheckpointReader(storage, storage.url, verify=verify, allowed_classes=allowed_classes).load(map_location)


def is_checkpoint(path: str, storage_options: dict | None = None) -> bool:
    """Whether ``path`` holds a committed checkpoint (its manifest exists)."""
    from ..storage.protocol import open_storage

    storage = open_storage(checkpoint_dir(path), storage_options)
    return storage.exists(storage.join(storage.url, MANIFEST))
