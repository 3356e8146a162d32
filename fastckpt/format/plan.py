"""Flatten a nested state into a tensor table and a JSON tree, and plan its file layout.

The plan (which tensor goes to which shard file at which offset) depends only on
the tensors' dtypes, shapes, copy class and owning rank, so it is cached: a
training loop that saves the same structure every N steps plans once and reuses
the host buffers that belong to the plan.

A DTensor leaf becomes one table entry per block of its mesh (``fastckpt.format.dtensor``),
every rank's blocks included, so all ranks plan alike; blocks of other ranks are
``meta`` tensors here (shape and dtype only) and are staged and written by their owner.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Collection, Hashable

import torch

from . import dtensor as dt
from .codec import encode_tree, path_name
from .identity import address, address_read
from ..errors import StateMismatchError

__all__ = ["TensorEntry", "Shard", "Plan", "FlatState", "DTensorRecord", "flatten", "Planner"]


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One unique tensor in the checkpoint."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    lazy: bool
    shard: int = -1
    offset: int = 0
    owner: int = -1  # global rank that writes it (DTensor blocks); -1: shared out by the Coordinator


@dataclass(slots=True)
class Shard:
    """One safetensors file: entries laid out back to back from ``offset`` 0."""

    index: int
    entries: list[TensorEntry] = field(default_factory=list)
    nbytes: int = 0
    lazy: bool = False
    owner: int = -1


@dataclass(slots=True)
class Plan:
    """The cached layout of one state structure (tensor names travel with each save)."""

    key: tuple
    entries: list[TensorEntry]
    shards: list[Shard]
    total_bytes: int
    plan_id: int = 0
    owned: set[int] | None = None  # shards this rank stages and writes (None: all of them)
    memo: dict[Any, Any] = field(default_factory=dict)  # what the engine derives from this plan once (engine/guard.py)

    def mine(self, shards: list[Shard]) -> list[Shard]:
        """The subset of ``shards`` this rank is responsible for."""
        return shards if self.owned is None else [s for s in shards if s.index in self.owned]


@dataclass(slots=True)
class DTensorRecord:
    """A DTensor leaf: its table entries (one per block) and where each block sits in the global tensor."""

    key: str
    layout: dt.Layout
    entries: list[int]  # table indices, in layout.chunks order; the tree refers to entries[0]
    mesh_ranks: list[int]
    tensor: Any = None  # the DTensor itself (load_into's target); never serialized

    def as_json(self) -> dict[str, Any]:
        return {"key": self.key, "dtype": str(self.layout.dtype).removeprefix("torch."),
                "shape": list(self.layout.shape), "entries": self.entries,
                "offsets": [list(c.offsets) for c in self.layout.chunks]}


@dataclass(slots=True)
class FlatState:
    """What ``flatten`` returns: unique tensors in table order, the JSON tree, pickled-object leaves."""

    tree: Any
    tensors: list[torch.Tensor]
    keys: list[str]
    numpy: list[bool]
    objects: list[Any]
    owners: list[int] = field(default_factory=list)  # per entry; -1 unless a DTensor block
    lazy_src: list[torch.Tensor] = field(default_factory=list)  # what decides the copy class (a block: its local tensor)
    dtensors: list[DTensorRecord] = field(default_factory=list)
    object_keys: list[str] = field(default_factory=list)  # key path of each pickled-object leaf (for errors)
    ids: list[Hashable] = field(default_factory=list)  # address() of each lazy_src: see ``identities``
    # format/flatcache.py's skeleton whose identity check this state passed (the same object for every save of the
    # same structure and tensors: what is derived from it once is reused); None: not cached
    token: Any = None

    def identities(self) -> list[Hashable]:
        """``address()`` of each entry's ``lazy_src``: which tensor it is (format/identity.py). Known to ``flatten``
        as it walks; a save asks for them three times (copy class, moved keys, stale parameters), each a torch call
        per tensor, on the training thread."""
        if len(self.ids) != len(self.lazy_src):
            self.ids = [address(src) for src in self.lazy_src]
        return self.ids


_key = path_name


def _data_ptr(t: torch.Tensor, path: tuple) -> int:
    """``t.data_ptr()``; a tensor with elements but no storage (a wrapper subclass) is refused by name."""
    try:
        ptr = t.data_ptr()
    except RuntimeError as e:  # fake and functional tensors raise
        ptr, err = 0, e
    else:
        err = None
    if ptr == 0 and t.numel() > 0:  # wrapper subclasses (_make_wrapper_subclass) report 0
        raise StateMismatchError(f"cannot checkpoint the {type(t).__name__} at {_key(path)!r}: it holds no "
                                 "readable data of its own (a tensor subclass without storage); convert it to a "
                                 "plain tensor first") from err
    return ptr


def _refuse_tensor(t: torch.Tensor, path: tuple) -> None:
    """Raise ``StateMismatchError`` for a tensor fastckpt cannot store bit-exactly (called inside save())."""
    if not (t.is_nested or t.layout is not torch.strided or t.is_quantized or t.is_meta):
        return  # every tensor of every save() passes here: its message is built only for a refusal
    where = f"cannot checkpoint the tensor at {_key(path)!r}"
    if t.is_nested:
        raise StateMismatchError(f"{where}: it is a nested tensor; save t.unbind() (a list of tensors) or "
                                 "t.to_padded_tensor(0) instead")
    if t.layout is not torch.strided:
        raise StateMismatchError(f"{where}: it has layout {t.layout} and only strided tensors are stored; save "
                                 "t.to_dense(), or the parts of a sparse tensor (t.indices(), t.values()) as tensors")
    if t.is_quantized:
        raise StateMismatchError(f"{where}: it is quantized ({t.dtype}) and its scale and zero point would be lost; "
                                 "save t.dequantize(), or t.int_repr() with t.q_scale() and t.q_zero_point()")
    raise StateMismatchError(f"{where}: it is a meta tensor and holds no data (a module built on the meta "
                             "device); materialize it first (module.to_empty(device=...), then initialize or load)")


def _view(t: torch.Tensor, ptr: int) -> tuple:
    """What makes two tensors at one address the same entry: x and x.conj() (or a neg view) share memory but not
    values, so the lazy bits are part of the identity."""
    return (ptr, t.shape, t.stride(), t.dtype, t.is_cuda, t.is_conj(), t.is_neg())


def flatten(state: Any) -> FlatState:
    """Walk ``state`` once; identical tensor views (tied weights) get one table entry."""
    flat = FlatState(tree=None, tensors=[], keys=[], numpy=[], objects=[])
    seen: dict[tuple, int] = {}  # DTensors
    # Plain tensors by data address first: the full view identity is built only where two share an address (a
    # save() walks hundreds of tensors, and each identity costs six torch calls)
    by_address: dict[int, list[int]] = {}
    used: set[str] = set()
    # Other ranks' blocks are shape-only meta tensors; one per (shape, dtype) serves them all
    # (a sharded state has tensors x mesh-size of them: 650k at 1024 ranks for a 1.3B model).
    metas: dict[tuple, torch.Tensor] = {}

    def unique(key: str) -> str:
        while key in used:  # keys from different containers may print alike
            key += "#"
        used.add(key)
        return key

    def add(t: torch.Tensor, key: str, is_numpy: bool, ident: Hashable, owner: int = -1,
            lazy_src: torch.Tensor | None = None) -> int:
        flat.tensors.append(t)
        flat.ids.append(ident)
        flat.keys.append(key)
        flat.numpy.append(is_numpy)
        flat.owners.append(owner)
        flat.lazy_src.append(t if lazy_src is None else lazy_src)
        return len(flat.tensors) - 1

    def on_tensor(path: tuple, t: torch.Tensor, is_numpy: bool) -> int:
        if type(t) is not torch.Tensor and dt.is_dtensor(t):
            return on_dtensor(path, t)
        _refuse_tensor(t, path)
        ptr = _data_ptr(t, path)
        shared = by_address.get(ptr) if ptr and not is_numpy else None
        if shared is not None:  # identical views of one memory (tied weights) share an entry
            mine = _view(t, ptr)
            for index in shared:
                if _view(flat.tensors[index], ptr) == mine:
                    return index
        index = add(t, unique(_key(path)), is_numpy, address_read(t, ptr))
        if ptr and not is_numpy:
            by_address.setdefault(ptr, []).append(index)
        return index

    def on_dtensor(path: tuple, t: Any) -> int:
        local = t._local_tensor
        # By address(), not data_ptr(): a rank whose block of a tied DTensor is empty must dedup it as the others do
        local_id = address(local)
        ident = ("dtensor", local_id, tuple(t.shape), t.dtype, tuple(t.placements), id(t.device_mesh))
        if local_id != 0 and ident in seen:  # a tied DTensor (0: a meta block has no identity)
            return seen[ident]
        key = unique(_key(path))
        layout = dt.layout_of(t, key)
        me = _global_rank()
        record = DTensorRecord(key, layout, [], [int(r) for r in t.device_mesh.mesh.flatten().tolist()], t)
        for chunk, where in zip(layout.chunks, layout.labels):
            if chunk.owner == me:
                if tuple(local.shape) != chunk.shape:
                    raise StateMismatchError(f"cannot checkpoint this state: DTensor {key!r}: the local tensor is "
                                             f"{list(local.shape)}, but its placements give this rank a block of "
                                             f"{list(chunk.shape)}")
                block = local
            else:  # another rank writes it: shape and dtype only
                block = metas.get((chunk.shape, t.dtype))
                if block is None:
                    block = metas[(chunk.shape, t.dtype)] = torch.empty(chunk.shape, dtype=t.dtype, device="meta")
            record.entries.append(add(block, f"{key}#dtensor@{where}", False, local_id, chunk.owner, local))
        flat.dtensors.append(record)
        seen[ident] = record.entries[0]
        return record.entries[0]

    flat.tree = encode_tree(state, on_tensor, flat.objects, object_keys=flat.object_keys)
    return flat


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _build_plan(key: tuple, entries: list[TensorEntry], chunk_bytes: int) -> Plan:
    # Eager tensors go first so that save() fills the leading shards and the copy
    # thread owns whole trailing shards; within a shard, wider dtypes first keeps
    # every offset aligned to its element size with no holes (safetensors forbids holes).
    # DTensor blocks are grouped by the rank that writes them: a shard file has one writer.
    order = sorted(entries, key=lambda e: (e.lazy, e.owner, e.index))
    shards: list[Shard] = []
    current = Shard(index=0)
    for e in order:
        if current.entries and (current.nbytes + e.nbytes > chunk_bytes or current.lazy != e.lazy
                                or current.owner != e.owner):
            shards.append(current)
            current = Shard(index=len(shards))
        current.entries.append(e)
        current.nbytes += e.nbytes
        current.lazy = e.lazy
        current.owner = e.owner
    if current.entries:
        shards.append(current)
    placed: list[TensorEntry | None] = [None] * len(entries)
    for shard in shards:
        offset = 0
        laid = []
        for e in sorted(shard.entries, key=lambda e: (-e.dtype.itemsize, e.index)):
            p = TensorEntry(e.index, e.dtype, e.shape, e.nbytes, e.lazy, shard.index, offset, e.owner)
            placed[e.index] = p
            laid.append(p)
            offset += e.nbytes
        shard.entries = laid
    return Plan(key=key, entries=placed, shards=shards, total_bytes=sum(s.nbytes for s in shards))  # type: ignore[arg-type]


class Planner:
    """Caches plans by structure. ``plans_built`` counts cache misses (tests assert on it)."""

    def __init__(self, chunk_bytes: int, capacity: int = 4) -> None:
        self._chunk_bytes = chunk_bytes
        self._cache: OrderedDict[tuple, Plan] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self.plans_built = 0
        # (token, chunk, lazy_ids, plan) of the last call with a reused flattening (format/flatcache.py)
        self._last: tuple[Any, int, frozenset, Plan] | None = None
        self.reused = 0  # calls answered by ``_last`` without a look at any tensor (tests assert on it)

    def plan(self, flat: FlatState, lazy_ids: Collection[Hashable], chunk_bytes: int | None = None) -> Plan:
        """Return the cached plan for this structure, building it on the first sight. ``lazy_ids``: the identities
        (``FlatState.identities``) of the tensors copied lazily. ``chunk_bytes``: this plan's shard size instead of
        the Planner's (a smaller one splits a shared file finer between ranks).

        A state whose flattening was reused (``flat.token``, the same skeleton: the same tensors, dtypes and shapes)
        with the same lazy identities gets the last plan back without a key built tensor by tensor."""
        chunk = self._chunk_bytes if chunk_bytes is None else chunk_bytes
        token, last = flat.token, self._last
        if (token is not None and last is not None and last[0] is token and last[1] == chunk
                and (last[2] is lazy_ids or last[2] == lazy_ids)):
            self.reused += 1
            return last[3]
        plan = self._plan(flat, lazy_ids, chunk)
        if token is not None:
            self._last = (token, chunk, lazy_ids if isinstance(lazy_ids, frozenset) else frozenset(lazy_ids), plan)
        return plan

    def _plan(self, flat: FlatState, lazy_ids: Collection[Hashable], chunk: int) -> Plan:
        lazy = [(not n) and i in lazy_ids for i, n in zip(flat.identities(), flat.numpy)]
        # Names are not part of the key: a state whose keys change every save (Lightning's
        # best_k_models is keyed by file path) still reuses one plan and one set of buffers.
        key = tuple((t.dtype, tuple(t.shape), lz, o) for t, lz, o in zip(flat.tensors, lazy, flat.owners))
        if chunk != self._chunk_bytes:
            key = (("chunk_bytes", chunk),) + key
        with self._lock:
            plan = self._cache.get(key)
            if plan is not None:
                self._cache.move_to_end(key)
                return plan
            entries = [
                TensorEntry(i, t.dtype, tuple(t.shape), t.numel() * t.element_size(), lz, owner=o)
                for i, (t, lz, o) in enumerate(zip(flat.tensors, lazy, flat.owners))
            ]
            plan = _build_plan(key, entries, chunk)
            self.plans_built += 1
            plan.plan_id = self.plans_built
            self._cache[key] = plan
            if len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
            return plan
