"""DTensor geometry: which rank holds which block of a sharded tensor.

A ``DTensor`` (FSDP2's parameters and optimizer state, tensor parallelism) is
saved as the blocks ("chunks") its ranks hold, each written once, by the lowest
rank that holds it (replicas on ``Replicate`` mesh dims are not written twice).
Every rank computes the layout of *every* rank from the global shape, the mesh
and the placements alone, so all ranks build the same plan with no
communication, and a reader can put any block anywhere: loading reassembles
full tensors, or copies just the overlapping regions into DTensors of another
mesh or placement (resharding).

``Partial`` placements (pending reductions) hold no block of the tensor, and
``_StridedShard`` (FSDP over tensor parallelism) interleaves blocks in a way
this layout does not describe: both are refused with an error saying what to do.
"""
from __future__ import annotations

import functools
import itertools
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import StateMismatchError

__all__ = ["Chunk", "Layout", "is_dtensor", "layout_of", "local_region", "overlap"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One block of a global tensor: where it starts, its shape, and the rank that writes it."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    owner: int  # global rank


@dataclass(frozen=True, slots=True)
class Layout:
    """How one DTensor is split over its mesh."""

    shape: tuple[int, ...]  # global
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]  # distinct blocks, in mesh order
    mesh_size: int
    labels: tuple[str, ...] = ()  # per chunk, its offsets as text ("17,0"): part of each block's table key


def is_dtensor(t: Any) -> bool:
    # A DTensor exists only once its module is imported: importing it here would add ~0.6 s to every
    # ``import fastckpt`` for users who never shard.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _check_placements(t: Any, key: str) -> None:
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    for p in t.placements:
        if isinstance(p, Partial):
            raise StateMismatchError(
                f"DTensor {key!r} has a Partial placement (a pending reduction), which holds no block of the "
                f"tensor; call .redistribute(placements=[Replicate()]) or .full_tensor() on it before saving")
        if not (isinstance(p, Replicate) or type(p) is Shard):  # _StridedShard subclasses Shard
            raise StateMismatchError(
                f"DTensor {key!r} has placement {p!r}; fastckpt saves Shard(dim) and Replicate() placements "
                f"(FSDP2 and 1-D/2-D sharding). For FSDP over tensor parallelism (_StridedShard), save "
                f".full_tensor() or redistribute to plain Shard placements first")


def layout_of(t: Any, key: str) -> Layout:
    """The chunks of every rank of ``t``'s mesh (the same on every rank)."""
    _check_placements(t, key)
    ranks = t.device_mesh.mesh  # global rank at each mesh coordinate
    return _layout(tuple(t.shape), t.dtype, tuple(t.placements), tuple(ranks.shape), tuple(ranks.flatten().tolist()))


# Every rank plans every rank's blocks, so one layout costs O(mesh size) and a state costs
# O(tensors x mesh size): 29 s per save at 1024 ranks for a 1.3B model uncached. The layers of a
# model repeat a handful of shapes, so the cache turns that into a few distinct layouts. Bounded:
# a layout holds a chunk per rank (256 layouts x 1024 ranks is ~60 MB at most).
@functools.lru_cache(maxsize=256)
def _layout(shape: tuple[int, ...], dtype: torch.dtype, placements: tuple, mesh_shape: tuple[int, ...],
            ranks: tuple[int, ...]) -> Layout:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    chunks: dict[tuple[tuple[int, ...], tuple[int, ...]], int] = {}
    for flat_index, coord in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
        local_shape, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        block = (tuple(int(o) for o in offsets), tuple(int(s) for s in local_shape))
        rank = ranks[flat_index]
        if block not in chunks or rank < chunks[block]:
            chunks[block] = rank  # replicas: the lowest rank writes
    # A rank may hold an empty block: FSDP2 splits dim 0 as torch.chunk, so Linear(32, 1) on 2 ranks gives rank 1
    # a [0, 32] weight, and 5 rows on 4 ranks give 2, 2, 1, 0. An empty block holds no byte; it is left out, so no
    # rank writes a file of nothing and the blocks kept still cover the tensor. A tensor with no element at all
    # keeps its first block: the tree refers to a DTensor by its first block.
    kept = {block: r for block, r in chunks.items() if all(block[1])} or dict([next(iter(chunks.items()))])
    ordered = tuple(Chunk(offsets=o, shape=s, owner=r) for (o, s), r in kept.items())
    labels = tuple(",".join(map(str, c.offsets)) for c in ordered)
    return Layout(shape=shape, dtype=dtype, chunks=ordered, mesh_size=len(ranks), labels=labels)


def local_region(t: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of the block of ``t`` this rank holds; a plain tensor holds all of itself."""
    if not is_dtensor(t):
        return (0,) * t.dim(), tuple(t.shape)
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    _check_placements(t, "target")
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        raise StateMismatchError("load_into: a target DTensor's mesh does not include this rank")
    shape, offsets = _compute_local_shape_and_global_offset(tuple(t.shape), tuple(t.device_mesh.mesh.shape),
                                                            list(coord), t.placements)
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shape)


def overlap(a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...],
            b_shape: tuple[int, ...]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Slices into block a and block b selecting their common region, or None if they do not meet."""
    sa, sb = [], []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if lo >= hi:
            return None
        sa.append(slice(lo - ao, hi - ao))
        sb.append(slice(lo - bo, hi - bo))
    return tuple(sa), tuple(sb)
