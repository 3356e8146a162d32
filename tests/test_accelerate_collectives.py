"""The small collectives of the Accelerate integration return only once gloo's worker thread has let go of
their tensors: a thread that drops them after the interpreter began to finalize aborts the process
(pytorch#190489), and torchrun then kills the other processes in the middle of their exit flush."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from fastckpt_accelerate import distributed
from fastckpt_accelerate.distributed import _until_gloo_lets_go, all_gather, broadcast_from_main
from tests.dist_launcher import run_ranks

_PAUSE = distributed._pause


def _drop_once_waited(holder: list, dropped: threading.Event) -> threading.Thread:
    """A thread that drops ``holder``'s references once the block is seen waiting for them (its first pause):
    a block that returned without waiting never pauses, so the drop comes after its end and the test fails."""
    waiting = threading.Event()
    pause = distributed._pause

    def pause_and_tell() -> None:
        waiting.set()
        pause()

    distributed._pause = pause_and_tell

    def drop() -> None:
        waiting.wait(timeout=30)
        dropped.set()
        holder.clear()

    thread = threading.Thread(target=drop, name="test-holder")
    thread.start()
    return thread


def _restore_pause() -> None:
    distributed._pause = _PAUSE


def test_waits_while_another_python_reference_is_held() -> None:
    tensor, holder, dropped = torch.zeros(4), [], threading.Event()
    try:
        with _until_gloo_lets_go([tensor]):
            holder.append(tensor)  # as a worker's reference would be
            thread = _drop_once_waited(holder, dropped)
        assert dropped.is_set()  # returned only after the other thread let go
    finally:
        _restore_pause()
        thread.join()


def _exchanges(rank: int, world: int) -> None:
    accelerator = SimpleNamespace(num_processes=world, is_main_process=rank == 0)
    for i in range(20):
        # Sizes differ per process (padding), one payload is large.
        mine = {"rank": rank, "i": i, "blob": b"x" * (rank * 1_000_000 + i)}
        gathered = all_gather(accelerator, mine)
        assert [g["rank"] for g in gathered] == list(range(world))
        assert all(g["i"] == i and g["blob"] == b"x" * (r * 1_000_000 + i) for r, g in enumerate(gathered))
        assert broadcast_from_main(accelerator, ("main's", rank, i)) == ("main's", 0, i)

    # The C++ side: a finished work still holds its tensors until it is dropped; the block waits for that.
    tensor = torch.arange(4.0) + rank
    outputs = [torch.empty(4) for _ in range(world)]
    works, dropped = [], threading.Event()
    try:
        with _until_gloo_lets_go([tensor, *outputs]):
            works.append(dist.all_gather(outputs, tensor, async_op=True))
            works[0].wait()
            thread = _drop_once_waited(works, dropped)
        assert dropped.is_set()
    finally:
        _restore_pause()
        thread.join()
    assert all(torch.equal(outputs[r], torch.arange(4.0) + r) for r in range(world))


@pytest.mark.timeout(180)
def test_exchanges_are_exact_and_wait_for_the_worker_to_let_go() -> None:
    run_ranks(_exchanges, 2)
