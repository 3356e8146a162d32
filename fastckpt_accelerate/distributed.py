"""The two small collectives a save or load needs, on the training process group, from the calling thread,
and the test of whether the processes may share the writes of one checkpoint.

The collectives carry a few kilobytes (RNG and dataloader states, a checkpoint path), and every process
reaches them from ``save_state``/``load_state``, which Accelerate already requires every process to call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import sys
import time
from typing import Any, Iterator, TypeVar

import torch
import torch.distributed as dist
from accelerate import Accelerator

from .naming import is_url

T = TypeVar("T")
log = logging.getLogger("fastckpt")

# How long a collective waits for gloo's worker thread to drop its tensors (normally microseconds).
_RELEASE_TIMEOUT_S = 30.0


def is_distributed(accelerator: Accelerator) -> bool:
    """Whether collectives are needed (and possible) for this accelerator."""
    return accelerator.num_processes > 1 and dist.is_available() and dist.is_initialized()


def all_gather(accelerator: Accelerator, obj: T) -> list[T]:
    """``obj`` from every process, indexed by process; every process gets the full list."""
    if not is_distributed(accelerator):
        return [obj]
    if not _cpu_runs_on_gloo():  # NCCL alone: CPU tensors cannot travel; torch's helper stages them on the GPU
        gathered: list[Any] = [None] * accelerator.num_processes
        dist.all_gather_object(gathered, obj)
        return gathered
    payload = pickle.dumps(obj)
    lengths = [_as_int(b) for b in _all_gather_once(torch.tensor([len(payload)], dtype=torch.int64))]
    padded = bytearray(max(lengths))
    padded[: len(payload)] = payload
    blobs = _all_gather_once(torch.frombuffer(padded, dtype=torch.uint8))
    # The processes are this job's own, and the objects fastckpt's small records (as all_gather_object's).
    return [pickle.loads(blob[:n]) for blob, n in zip(blobs, lengths)]


def broadcast_from_main(accelerator: Accelerator, obj: T) -> T:
    """The main process's ``obj`` on every process."""
    if not is_distributed(accelerator):
        return obj
    if not _cpu_runs_on_gloo():
        box: list[Any] = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    payload = pickle.dumps(obj) if accelerator.is_main_process else b""
    length = _as_int(_broadcast_once(torch.tensor([len(payload)], dtype=torch.int64)))
    buffer = bytearray(payload) if accelerator.is_main_process else bytearray(length)
    return pickle.loads(_broadcast_once(torch.frombuffer(buffer, dtype=torch.uint8)))


# Why not dist.all_gather_object / broadcast_object_list: when a collective returns, gloo's worker thread
# still holds its work, and drops it (and with it the tensors' Python objects, which needs the GIL) a moment
# later. A script that saves and then ends without end_training() reaches interpreter finalization within
# milliseconds; a worker thread that needs the GIL after that cannot have it, and the process aborts
# ("terminate called without an active exception", pytorch#190489), which torchrun answers by killing the
# other processes mid-flush. So each exchange below keeps its tensors and returns only once gloo has let go.


def _all_gather_once(tensor: torch.Tensor) -> list[bytes]:
    """Every process's ``tensor`` (same shape everywhere), as bytes."""
    outputs = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    with _until_gloo_lets_go([tensor, *outputs]):
        dist.all_gather(outputs, tensor, async_op=True).wait()
    return [t.numpy().tobytes() for t in outputs]


def _broadcast_once(tensor: torch.Tensor) -> bytes:
    """Process 0's ``tensor``, as bytes."""
    with _until_gloo_lets_go([tensor]):
        dist.broadcast(tensor, src=0, async_op=True).wait()
    return tensor.numpy().tobytes()


@contextlib.contextmanager
def _until_gloo_lets_go(tensors: list[torch.Tensor]) -> Iterator[None]:
    """Run a collective over ``tensors``, then wait until no other thread references them.

    While C++ holds a tensor, the tensor also holds its Python object; the worker thread's release drops
    that reference under the GIL. Seeing the C++ count at one and the Python count back where it was means
    that thread is done with the GIL for these tensors. The wait is a few microseconds (often none).
    """
    before = _python_refs(tensors)
    yield
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    while _python_refs(tensors) != before or _cpp_refs(tensors) != [1] * len(tensors):
        if time.monotonic() > deadline:
            log.debug("fastckpt: a gloo worker thread still held a finished collective after %ss", _RELEASE_TIMEOUT_S)
            return
        _pause()


def _pause() -> None:
    # A condition with no event to wait on (nothing signals when a C++ thread drops a reference): give the
    # GIL away briefly, which the worker thread needs to let go, then look again.
    time.sleep(0.0002)


def _python_refs(tensors: list[torch.Tensor]) -> list[int]:
    # Indexing, not iterating: a loop variable or zip()'s reused tuple would hold a reference of its own.
    return [sys.getrefcount(tensors[i]) for i in range(len(tensors))]


def _cpp_refs(tensors: list[torch.Tensor]) -> list[int]:
    return [tensors[i]._use_count() if hasattr(tensors[i], "_use_count") else 1 for i in range(len(tensors))]


def _as_int(raw: bytes) -> int:
    return int.from_bytes(raw, sys.byteorder, signed=True)


def _cpu_runs_on_gloo() -> bool:
    """Whether CPU tensors go through gloo on the default group (gloo alone, or "cpu:gloo,cuda:nccl")."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).name() == "gloo"
    except (RuntimeError, AttributeError):
        return False


def can_share_writes(accelerator: Accelerator, root: str) -> bool:
    """Whether every process can write its part of a checkpoint under ``root`` for rank 0 to commit.

    True for an object store (``s3://``...) and for a local path when every process runs on this node
    (torchrun's ``LOCAL_WORLD_SIZE`` equals the world size). Not for node-local disks of several nodes
    (rank 0 would commit files it cannot see), nor for ``memory://``, which is private to each process.
    """
    if not is_distributed(accelerator):
        return False
    if is_url(root):
        return not root.startswith("memory://")
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    return local_world is not None and int(local_world) == accelerator.num_processes
