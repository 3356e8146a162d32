"""Staging buffers made before the first save needs them: ``Checkpointer.prewarm(state)``.

A slot makes each buffer the first time a copier asks for it (engine/staging.py), on the copy thread for lazy
shards: the first checkpoint of a run pays for making its memory, page-locking it on CUDA (``cudaHostRegister``,
0.39 s per GB on an H200: the first checkpoint stalled 1,297 ms there against 113 ms for the later ones) and the
batched pass's layouts. ``prewarm`` plans the state as ``save()`` would, takes a slot and makes all of that on a
thread of its own (``fastckpt-prewarm-N``, owned by ``Prewarm``, joined at ``close()``), then gives the slot back:
the first save finds everything made, the compiled pass (``staging.compiled_pass``, format/fused.py) included: its
warm-up starts here and the Future waits for it. A slot's bytes must fit the host's available memory (psutil), else
``ConfigError`` names ``staging.max_host_bytes``, which streams the state through a ring of smaller buffers.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from concurrent.futures import Future

import psutil
import torch

from ..errors import ConfigError
from ..format import fused
from ..format.plan import Plan
from .staging import HostArena

__all__ = ["Prewarm"]

_ids = itertools.count(1)


class Prewarm:
    """The prewarming threads of one ``Checkpointer``."""

    def __init__(self, arena: HostArena, compiled_pass: str = "off") -> None:
        self._arena = arena
        self._compiled_pass = compiled_pass  # staging.compiled_pass: its warm-up starts at prewarm() too...
        if compiled_pass == "on":
            fused.warm("on")  # ...and, with "on", now: compiled while the model is built, ready for the first save
        self._threads: list[threading.Thread] = []

    def start(self, plan: Plan, devices: list[int]) -> Future:
        """Called by ``Checkpointer.prewarm``: make every buffer of one slot of ``plan`` (page-locked when the
        state is on CUDA ``devices``) in the background; the Future gives the bytes made (0: all existed)."""
        need = self._arena.slot_bytes(plan)
        free = psutil.virtual_memory().available
        if need > free:
            raise ConfigError(f"prewarm(): a staging slot of this state takes {need / 2**30:.2f} GiB of host "
                              f"memory and {free / 2**30:.2f} GiB is available; set staging.max_host_bytes (the "
                              "state then streams through a ring of smaller buffers) or free host memory")
        pin = bool(devices)
        kernel = fused.warm(self._compiled_pass)  # the compiled pass (format/fused.py): its own thread, once
        on_device = torch.cuda.device(devices[0]) if pin else contextlib.nullcontext()
        with on_device:  # buffers register under the state's device: no stray context on GPU 0
            slot = self._arena.acquire(plan, pin, block=False)
        done: Future = Future()
        if slot is None:  # every slot is taken by a save: their buffers exist
            kernel.add_done_callback(lambda _: done.set_result(0))
            return done
        before = self._arena.allocated_bytes

        def run() -> None:
            try:
                shards = plan.mine(plan.shards)
                with torch.cuda.device(devices[0]) if pin else contextlib.nullcontext():
                    for shard in shards[:slot.ring_count] if slot.ring else shards:  # ring mode: each of its buffers
                        buf = slot.buffer(shard)
                        if not pin:  # the copy thread's batched pass (format/batchpass.py)
                            slot.layout(shard, buf, [e.dtype for e in shard.entries])
                made = self._arena.allocated_bytes - before
                kernel.result()  # never raises: None where the warm-up failed (said there)
                done.set_result(made)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's future
                done.set_exception(e)
            finally:
                self._arena.release(slot)

        thread = threading.Thread(target=run, name=f"fastckpt-prewarm-{next(_ids)}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return done

    def close(self) -> None:
        """Called by ``Checkpointer.close`` before the arena drops its buffers: the prewarming threads end first."""
        for thread in self._threads:
            thread.join()
        self._threads = []
