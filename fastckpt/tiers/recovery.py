"""Which snapshots left in shared memory by a crashed process a new ``Checkpointer`` recovers.

A snapshot is recovered only if its record is valid (``fastckpt.format.shm_record``), every
staged buffer exists with the size the plan says, and the bytes match the checksums
taken when they were staged. With ``distributed=True`` each rank staged only its share,
so the ranks also agree: a snapshot is recovered only when every rank holds a verified
part of it, and discarded (loudly, on every rank) otherwise. Never half a checkpoint.
"""
from __future__ import annotations

import logging
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Callable, Iterable

import torch.distributed as dist

from ..errors import FastCkptError
from ..format.shm_record import StagedRecord
from ..engine.handle import SaveHandle
from ..engine.staging import Slot

if TYPE_CHECKING:
    from ..engine.distributed import Coordinator
    from .shm import ShmTier

__all__ = ["recover", "recoverable"]

log = logging.getLogger("fastckpt")


def recover(tier: "ShmTier | None", coord: "Coordinator | None", claim: Callable[[Iterable[str]], None],
            submit: Callable[[StagedRecord, Slot], SaveHandle]) -> list[SaveHandle]:
    """Persist the snapshots a crashed process had staged in shared memory, and return once they are committed
    (or failed: raised at the next save/wait/close), so that ``latest()`` and ``load()`` already see them.
    ``claim``: take the root before writing into it, sparing the named folders; ``submit``: queue one snapshot.
    ``tier`` None: this rank's namespace was refused (``ShmTier.open_namespace``); it recovers nothing, but with
    ``coord`` still takes its part in the ranks' agreement, which the others wait for."""
    if tier is None:
        if coord is not None:
            _agreed([], None, coord)
        return []
    with tier.recovering():
        found = list(recoverable(tier, coord))
        if found:
            claim({rec.name for rec, _ in found})  # persisting them writes into the root
        handles = [submit(rec, slot) for rec, slot in found]
        for h in handles:
            h.blocking()  # this (the training) thread waits for them
        wait_futures([h.durable for h in handles])
    return handles


def recoverable(tier: "ShmTier", coord: "Coordinator | None") -> list[tuple[StagedRecord, Slot]]:
    """The verified snapshots to persist, oldest step first, each with its recovered slot.

    Called by the ``Checkpointer`` constructor; with ``coord`` it is collective (every rank
    constructs its Checkpointer together) and runs before any job uses the gloo group.
    """
    found = []
    for rec in tier.orphans():
        try:
            found.append((rec, tier.open_slot(rec)))
        except FastCkptError as e:
            tier.discard(rec.dir, e)
    return found if coord is None else _agreed(found, tier, coord)


def _agreed(found: list[tuple[StagedRecord, Slot]], tier: "ShmTier | None",
            coord: "Coordinator") -> list[tuple[StagedRecord, Slot]]:
    """Keep what every rank holds verified; all ranks compute the same list in the same order."""
    mine = {rec.uid: (rec.name, rec.step) for rec, _ in found}
    everyone: list[dict[str, tuple[str, int]]] = [{} for _ in range(coord.world)]
    dist.all_gather_object(everyone, mine, group=coord.group)
    kept = []
    for rec, slot in found:
        missing = [r for r, theirs in enumerate(everyone) if tuple(theirs.get(rec.uid) or ()) != (rec.name, rec.step)]
        if missing:
            assert tier is not None  # None only when this rank found nothing
            tier.discard(rec.dir, f"{rec.label}: rank(s) {missing} hold no verified part of it, so it cannot be "
                                  "committed whole")
            continue
        kept.append((rec, slot))
    for r, theirs in enumerate(everyone):
        for uid, (name, step) in theirs.items():
            if uid not in mine:
                log.warning("fastckpt: rank %d staged checkpoint %r (step %d, uid %s) before the crash, but this "
                            "rank (%d) holds no verified part of it: it is NOT recovered, on any rank", r, name, step,
                            uid, coord.rank)
    return kept
