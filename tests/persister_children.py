"""Training processes for the persister process's SIGKILL trials, run from a forkserver (torch imported once).

Each child saves with ``persist.process: on``, reports its persister's pid (once started), then every step whose
``wait_staged()`` returned, and is SIGKILLed by the test at a moment the trial picks.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from typing import Any

from fastckpt import CheckpointConfig, Checkpointer
from tests.shm_children import model, set_step, state

_CTX: Any = None


def context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload([__name__])
    return _CTX


def config(root: str, shm: str, **persist: Any) -> CheckpointConfig:
    return CheckpointConfig(root=root, staging={"shm": True, "shm_dir": shm},
                            persist={"chunk_bytes": 4096, "fsync": False, "process": "on", **persist})


def train(conn: Connection, root: str, shm: str, steps: int, seal_last: bool) -> None:
    """Save steps 1..steps (each reported once staged, then sealed by the optimizer's step, which commits it in the
    persister), the last one sealed only if ``seal_last``; then wait for the SIGKILL."""
    ck = Checkpointer(config(root, shm))
    m, opt = model()
    ck.watch(opt)
    for step in range(1, steps + 1):
        set_step(m, step)
        ck.save(state(m, step), step=step).wait_staged()
        if step == 1:
            conn.send(ck._pipeline.persister.pid)  # started by the first save
        conn.send(step)
        if step < steps or seal_last:
            opt.zero_grad(set_to_none=True)
            opt.step()  # no gradients: the parameters stay; its pre-hook seals the snapshot (the commit may go on)
    conn.send("done")
    threading.Event().wait()
