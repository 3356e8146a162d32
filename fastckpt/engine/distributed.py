"""Data-parallel ranks share the work of one checkpoint.

Every rank calls ``save()`` with the same replicated state. The plan is identical
on every rank, so shard ownership is computed locally with no communication: a
greedy, size-sorted balance that is deterministic (DCP's dedup is greedy and
unsorted, so its owners can differ between runs). Each rank copies and writes only
its own shards. The commit protocol runs on the committer threads over a
dedicated gloo group, never the training process group, so it cannot interleave
with the model's collectives:

1. every rank gathers its file records (or its error) to rank 0;
2. rank 0 writes the metadata and the manifest (the commit) if every rank succeeded;
3. rank 0 broadcasts the outcome, so every rank's handle resolves the same way.

DTensor blocks (FSDP2, tensor parallelism) are the exception to the balance: each is
written by the rank that holds it (see ``fastckpt.format.dtensor``).

Loading reads each file once: its owner reads and verifies it, then broadcasts the
bytes to the other ranks. Loading into DTensors reads, on each rank, only the
blocks that overlap its own.
"""
from __future__ import annotations

import hashlib
import heapq
import logging
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import ConfigError, StateMismatchError, StorageError
from ..format.plan import Plan, TensorEntry
from .partplan import contiguous_owners

__all__ = ["Coordinator", "balance", "shard_owners"]

log = logging.getLogger("fastckpt")


def balance(sizes: list[int], world: int, start: list[int] | None = None) -> list[int]:
    """Owner rank of each item: largest first onto the least-loaded rank (ties: lowest rank).

    ``start`` is each rank's load before these items (the blocks it must write anyway). A heap keeps
    this O(items log world): a scan over the ranks per item took seconds at 1024 ranks.
    """
    heap = [(0 if start is None else start[r], r) for r in range(world)]
    heapq.heapify(heap)
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(heap)
        owner[i] = r
        heapq.heappush(heap, (load + sizes[i], r))
    return owner


def shard_owners(plan: Plan, world: int, group_rank: Callable[[int], int] = int, *,
                 spread_eager: bool = False) -> dict[int, int]:
    """The rank (in the group) that stages and writes each shard of ``plan``, computed alike on every rank.

    DTensor blocks are written by the rank that holds them (``group_rank`` maps the block's global
    owner into the group). Eager tensors (BatchNorm buffers, unwatched state) may differ between
    ranks; DDP treats rank 0's as the truth (broadcast_buffers), so rank 0 writes all of them. Only
    optimizer-managed replicated tensors, identical on every rank, are spread out, first onto the
    ranks the blocks and eager tensors left lightest (FSDP2's uneven splits give low ranks more rows).

    ``spread_eager``: the caller marked what only rank 0 may write with an owner (``save_file`` on several
    ranks: everything but the optimizers' parameters and state), so eager shards without one are spread too.
    """
    owners: dict[int, int] = {}
    load = [0] * world
    for s in plan.shards:
        if s.owner >= 0 or not (s.lazy or spread_eager):
            owners[s.index] = group_rank(s.owner) if s.owner >= 0 else 0
            load[owners[s.index]] += s.nbytes
    lazy = [s for s in plan.shards if (s.lazy or spread_eager) and s.owner < 0]
    owners.update((s.index, r) for s, r in zip(lazy, balance([s.nbytes for s in lazy], world, load)))
    return owners


def _describe(key: str, entry: TensorEntry) -> str:
    """One planned tensor as a user reads it: its name, dtype, global shape, copy class and writer."""
    kind = "lazy: a watched optimizer's tensor" if entry.lazy else "eager: no watched optimizer's tensor"
    block = f", a block written by rank {entry.owner}" if entry.owner >= 0 else ""
    return f"{key!r} as {str(entry.dtype).removeprefix('torch.')} {list(entry.shape)} ({kind}{block})"


class Coordinator:
    """Rank-aware planning and the commit protocol; one per distributed ``Checkpointer``."""

    def __init__(self, group: Any = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("distributed=True needs torch.distributed initialized (init_process_group) first")
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        # A private gloo group: background threads must never issue collectives on the
        # training group (NCCL or gloo), or they would interleave with the model's.
        self.group = dist.new_group(ranks=ranks, backend="gloo")
        self._checked: set[int] = set()
        # File names carry a per-save uid that all ranks must agree on; saves are collective,
        # so a shared nonce plus a local counter gives the same uid everywhere with no traffic.
        box = [uuid.uuid4().hex]
        dist.broadcast_object_list(box, src=self._dst(), group=self.group)
        self._nonce = box[0]
        self._saves = 0

    def close(self) -> None:
        """Destroy the private group once its last collective is done (``Checkpointer.close``, after the drain).

        Why now: a gloo worker thread drops its finished work a moment after the caller's ``wait()`` returns,
        and that drop releases the tensors' Python objects, which needs the GIL. If the interpreter is already
        finalizing (a script that ended with a save in flight, flushed by the exit hook), the thread cannot take
        the GIL and the process aborts ("terminate called without an active exception", pytorch#190489).
        Destroying the group drains its queue and joins its threads while the interpreter is alive.
        """
        group, self.group = self.group, None
        if group is None:
            return
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError) as e:  # the user destroyed every group first: nothing left to join
            log.debug("fastckpt: the private process group was already gone: %s", e)

    def next_uid(self) -> str:
        """Called by ``save()`` on every rank, in the same order."""
        self._saves += 1
        return hashlib.sha1(f"{self._nonce}-{self._saves}".encode()).hexdigest()[:12]

    # ---- planning (training thread) -------------------------------------------------

    def agreed(self, plan: Plan) -> bool:
        """Whether the ranks already agreed on ``plan`` (``assign`` then runs no collective)."""
        return plan.plan_id in self._checked

    def assign(self, plan: Plan, keys: list[str]) -> None:
        """Give ``plan`` its owned shards; on first sight, check every rank planned the same (a collective: run it
        where the private group's other collectives are ordered, see ``Saver``; ``keys``: the name of each table
        entry, for the error that says where the ranks differ)."""
        if plan.plan_id in self._checked:
            return
        digest = hashlib.sha1(repr(plan.key).encode()).hexdigest()
        digests: list[Any] = [None] * self.world
        dist.all_gather_object(digests, digest, group=self.group)
        if len(set(digests)) != 1:
            raise StateMismatchError(
                "ranks passed states with different structures to save(): " + self._first_difference(plan, keys)
                + ". With distributed=True every rank must save the same structure: the same keys, dtypes and "
                "global shapes, the same optimizers watched and the same save(eager=/lazy=) (per-rank state belongs "
                "in a separate checkpoint)")
        owners = shard_owners(plan, self.world, self._group_rank)
        mine = {index for index, r in owners.items() if r == self.rank}
        plan.owned = mine
        self._checked.add(plan.plan_id)

    def _first_difference(self, plan: Plan, keys: list[str]) -> str:
        """Where each rank's plan first departs from rank 0's, the same text on every rank (failure path only:
        rank 0's entry list travels to every rank once)."""
        mine = [_describe(key, entry) for key, entry in zip(keys, plan.entries)]
        reference = self.share(mine)
        found = None
        for ours, theirs in zip(mine, reference):
            if ours != theirs:
                found = f"{theirs} on rank 0 but {ours} on rank {self.rank}"
                break
        if found is None and len(mine) != len(reference):
            longer, who = (reference, "rank 0") if len(reference) > len(mine) else (mine, f"rank {self.rank}")
            extra = longer[min(len(mine), len(reference))]
            found = f"{len(reference)} tensors on rank 0 but {len(mine)} on rank {self.rank}; {who} also has {extra}"
        found_all: list[Any] = [None] * self.world
        dist.all_gather_object(found_all, found, group=self.group)
        found_any = [f for f in found_all if f]
        if not found_any:
            return "their plans differ in layout (report this as a bug)"
        more = f"; and {len(found_any) - 3} more ranks" if len(found_any) > 3 else ""
        return "; ".join(found_any[:3]) + more

    def assign_file(self, plan: Plan, contiguous: bool = False) -> list[int]:
        """Give ``plan`` (one torch file shared by the ranks) its owned shards; return the rank that writes each
        entry. No collective here, as the ranks' plans may differ: the commit protocol compares what this returns
        (``fastckpt.engine.sharedfile``). ``contiguous``: each rank one stretch of the file (one S3 object's
        parts, ``fastckpt.engine.sharedobject``), rather than a balance of scattered shards."""
        if contiguous:
            owners = contiguous_owners(plan.shards, self.world, self._group_rank)
        else:
            owners = shard_owners(plan, self.world, self._group_rank, spread_eager=True)
        plan.owned = {index for index, r in owners.items() if r == self.rank}
        return [owners[e.shard] for e in plan.entries]

    @property
    def leader(self) -> int:
        """The global rank of this group's rank 0 (the committer)."""
        return self._dst()

    def _group_rank(self, global_rank: int) -> int:
        """The rank in this Checkpointer's group of a DTensor block's owner."""
        try:
            return dist.get_group_rank(self.group, global_rank)
        except ValueError as e:
            raise ConfigError(f"a DTensor block is held by rank {global_rank}, which is not in this Checkpointer's "
                              "process group; construct the Checkpointer over a group that spans the DTensor's "
                              "mesh") from e

    # ---- commit protocol (committer thread) --------------------------------------------

    def gather(self, results: list[Any], error: BaseException | None) -> tuple[list[Any], str | None]:
        """All ranks: send results/error to rank 0. Rank 0 gets everyone's results and the first error."""
        mine = (self.rank, results if error is None else None, None if error is None else f"rank {self.rank}: {error}")
        everyone: list[Any] = [None] * self.world if self.rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(mine, everyone, dst=self._dst(), group=self.group)
        if self.rank != 0:
            return [], None
        merged: list[Any] = []
        errors = [e for _, _, e in everyone if e]
        for _, res, _ in everyone:
            merged.extend(res or [])
        return merged, (errors[0] if errors else None)

    def outcome(self, error: str | None) -> str | None:
        """All ranks: rank 0's verdict (None for committed, else the error text)."""
        return self.share(error)

    def share(self, obj: Any) -> Any:
        """All ranks: rank 0's ``obj`` (small, picklable)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self._dst(), group=self.group)
        return box[0]

    def _dst(self) -> int:
        return dist.get_global_rank(self.group, 0)

    # ---- loading (training thread, collective) -----------------------------------------

    def share_files(self, names: list[str], sizes: list[int], read: Any) -> dict[str, torch.Tensor]:
        """Each file is read by one rank and broadcast to all: storage sees every byte once."""
        owners = balance(sizes, self.world)
        buffers: dict[str, torch.Tensor] = {}
        local_err: BaseException | None = None
        for name, owner in zip(names, owners):
            if owner == self.rank:
                try:
                    buffers[name] = read(name)
                except BaseException as e:  # noqa: BLE001 - shared below so no rank hangs
                    local_err = e
        errors: list[Any] = [None] * self.world
        dist.all_gather_object(errors, None if local_err is None else repr(local_err), group=self.group)
        if local_err is not None:
            raise local_err
        failed = [e for e in errors if e]
        if failed:
            raise StorageError(f"another rank could not read the checkpoint: {failed[0]}")
        for name, size, owner in zip(names, sizes, owners):
            buf = buffers.get(name)
            if buf is None:
                buf = torch.empty(size, dtype=torch.uint8)
            dist.broadcast(buf[:size], src=dist.get_global_rank(self.group, owner), group=self.group)
            buffers[name] = buf
        return buffers
