"""A CUDA job's shards as the pipeline's threads stage them: queued in batches, seen landed, measured on the device.

engine/pipeline.py calls these for a job with ``job.cuda`` set (a state with CUDA tensors): the copy thread, and
``save()`` for eager shards, ``queue_shard``; an I/O worker (or the shared-memory check) ``landed`` before it reads
the staged bytes, then ``shard_stats``; the committer ``all_landed`` before it frees the slot of a failed save;
``submitted`` once ``save()`` hands the job over. What the copies and the figures are: engine/cudacopy.py,
engine/devicehealth.py; the device snapshot: engine/devicesnap.py.
"""
from __future__ import annotations

from typing import Any

import torch

from ..format.health import shard_health
from ..format.openlayout import OPEN_LAYOUT
from .cudacopy import device_batches, queue_copies
from .devicehealth import finish, queue_stats
from .onepass import batch_layout
from .staging import copy_entries
from .streams import host_wait, record_done, shard_events, snapshotted

__all__ = ["all_landed", "landed", "queue_shard", "shard_stats", "submitted"]


def queue_shard(job: Any, shard: Any, buf: torch.Tensor, streams: dict[int, Any]) -> None:
    """Queue ``shard``'s device-to-host copies into ``buf``, one batch a device on that device's stream in
    ``streams``, each device's health figures after them on the same stream (measured, open layout), then its
    "copied" event (``job.shard_events``); CPU sources are copied now. The sources are the device snapshot's where
    one was taken. The mutation guard, if any, checks every entry before and after."""
    cuda = job.cuda
    check = job.guard.check if job.guard is not None else None
    if check is not None:
        for e in shard.entries:
            check(e.index)
    tensors = cuda.snapshot if cuda.snapshot is not None else job.tensors
    batches, on_cpu = device_batches(shard.entries, tensors)
    if on_cpu:
        copy_entries(buf, on_cpu, tensors)
    views = job.slot.views(shard, buf) if batches else []
    measure = job.health is not None and job.file_format is OPEN_LAYOUT
    for batch in batches:
        stream = streams[batch.device]
        queue_copies(views, batch, stream)
        key = (shard.index, batch.device)
        cuda.kept[key] = batch.sources  # before the event exists: whoever sees it done drops them
        if measure:
            stats = queue_stats(batch, stream)
            if stats is not None:
                cuda.stats[key] = stats
        job.shard_events[key] = record_done(stream)
    if check is not None:
        for e in shard.entries:
            check(e.index)


def landed(job: Any, shard: Any) -> bool:
    """Block until ``shard``'s CUDA copies are done (blocking events: the thread sleeps), then drop the sources
    they read; False when it has none."""
    events = shard_events(job.shard_events, shard.index)
    if not events:
        return False
    host_wait(events)
    if job.cuda is not None:
        for d, _ in events:
            job.cuda.kept.pop((shard.index, d), None)  # a source the caller freed may be reused from now on
    return True


def all_landed(job: Any) -> None:
    """Block until every CUDA copy of ``job`` is done (a failed save: its slot is about to be reused), then drop
    every source they read."""
    host_wait((d, ev) for (_, d), ev in job.shard_events.items())
    if job.cuda is not None:
        job.cuda.kept.clear()


def shard_stats(job: Any, shard: Any, buf: torch.Tensor, fmt: Any) -> dict[str, Any]:
    """The I/O worker's, after ``landed``: ``shard``'s health statistics by key, from the device's figures where they
    were taken (the rest measured here), else by the host's pass over the staged bytes (format/health.py's
    ``shard_health``, which takes the format's checksums on the way)."""
    figures = [st for (s, _), st in list(job.cuda.stats.items()) if s == shard.index] if job.cuda is not None else []
    if figures:
        return finish(figures, buf, shard.entries, job.keys)
    return shard_health(job, shard, buf, fmt, batch_layout(job, shard, buf, fmt))


def submitted(job: Any) -> None:
    """Called once ``save()`` hands ``job`` to the pipeline: with a device snapshot, the next save's snapshot waits
    for this job's copies, and its figures say it was taken."""
    if snapshotted(job):
        job.cuda.snapshots.used_by(job)
        job.handle.stats.device_snapshot = True
