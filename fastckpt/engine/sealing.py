"""A lazy job's seal as the pipeline runs it: the copy thread's staged samples, the verdict and the refusal.

engine/seal.py measures (samples, comparisons on the CPU or the device); this module decides, on the threads of
engine/pipeline.py: the copy thread samples the staged bytes of the CUDA shards it only queued once they landed
(``record_staged``, after ``wait_staged()`` is released), the training thread seals (``seal_job``: a refusal is
recorded for ``on_mutation: raise``, or a retake returned), and the committer collects a device verdict the seal
left pending before it commits (``await_seal``).
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import SnapshotMutatedError
from .seal import mutated_error
from .streams import host_wait, shard_events

__all__ = ["await_seal", "record_staged", "seal_job"]


def record_staged(job: Any) -> None:
    """Called by the copy thread after ``wait_staged()`` is released (the training thread orders its next kernels
    after the copies on the GPU): the seal's staged samples of the shards whose copies were only queued, each once
    landed. Always tells the seal it is done, so that no verdict waits forever."""
    try:
        for shard in job.to_record:
            host_wait(shard_events(job.shard_events, shard.index))
            job.seal.record(job.slot.held(shard), shard.entries)
    except BaseException as e:  # noqa: BLE001 - reported through the job (the committer raises it)
        job.error = job.error or e
    finally:
        if job.seal is not None:
            job.seal.recorded()


def seal_job(job: Any, on_refused: Callable[[Any, BaseException], None] | None) -> Callable[[], None] | None:
    """The seal (``SaveHandle.seal``, on the training thread, staging complete): refuse the snapshot if a lazy
    source moved since ``save()``; returns the retake to run once the committer may go on, if any."""
    if job.seal is None or (job.error is not None and not isinstance(job.error, SnapshotMutatedError)):
        return None
    try:
        return _sealed(job, on_refused)
    finally:
        let_go(job)


def let_go(job: Any) -> None:
    """Drop the save's references to its tensors here, on the sealing (training) thread, once staging and the
    seal no longer need them: freeing a tensor object hands the GIL over, and the committer freeing the hundreds of
    a state with the job made a launch-bound training thread wait at each (``python -m benchmarks.gilcalls``)."""
    job.tensors[:] = [None] * len(job.tensors)
    job.version_src = None
    job.seal.let_go()
    if job.guard is not None:
        job.guard.let_go()


def _sealed(job: Any, on_refused: Callable[[Any, BaseException], None] | None) -> Callable[[], None] | None:
    moved = job.seal.moved()  # all of them, also when the copy thread already refused the first it saw
    if not moved and job.seal.pending() and job.retake is not None:
        moved = job.seal.verdict()  # CUDA: a retake is decided now (one wait); else the committer collects it
    if job.error is None and not moved:
        return None
    if job.error is None:
        job.error = mutated_error(job.handle.name, moved)
    retake = job.retake
    if retake is None:
        if on_refused is not None:
            on_refused(job, job.error)  # raised by the save() that sealed it, or the next save/wait/close
        return None
    job.retaken = True
    keys = moved or [k for k in job.keys if repr(k) in str(job.error)]
    return lambda: (job.cleared.wait(), retake(keys))  # type: ignore[func-returns-value]


def await_seal(job: Any) -> None:
    """The committer: block until ``job`` is staged and sealed, and collect the seal's device answer (CUDA,
    ``on_mutation: raise``: the seal only queued its comparisons); a refusal becomes ``job.error``."""
    job.handle.await_staging()
    if job.error is None and job.seal is not None and job.seal.pending():
        moved = job.seal.verdict()
        if moved:
            job.error = mutated_error(job.handle.name, moved)
