"""A writer process for the lifecycle tests, driven through its stdin and stdout (no sleeps).

    python -m tests.lifecycle_child ROOT MODE

It commits step 1 (``torch.full((4096,), 1.0)`` under "w"), then, by MODE:

* ``hold``: prints ``holding PID`` and waits; ``close`` on stdin closes the Checkpointer (prints ``closed``),
  then EOF ends the process;
* ``save``: a second save of step 2 blocks in its second file write; prints ``stuck PID`` (to be SIGKILLed);
* ``delete``: keep_last=1; step 2 commits and retention deletes step 1, blocking after its manifest and first
  file are gone; prints ``stuck PID`` (to be SIGKILLed).
"""
from __future__ import annotations

import os
import sys
import threading

import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.storage.local import LocalStorage
from tests.helpers import WrappedStorage

STATE = {"w": torch.full((4096,), 1.0), "b": torch.full((4096,), 2.0)}


class StickyStorage(WrappedStorage):
    """Passes ``free`` writes/deletes (of ``what``), then blocks forever on the next one, saying so."""

    def __init__(self, inner: LocalStorage) -> None:
        super().__init__(inner)
        self.armed = threading.Event()
        self.what = ""
        self.free = 0

    def write_file(self, path, parts) -> None:
        self._maybe_stick("write", path)
        self.inner.write_file(path, parts)

    def delete(self, path) -> None:
        self._maybe_stick("delete", path)
        self.inner.delete(path)

    def _maybe_stick(self, op: str, path: str) -> None:
        if self.armed.is_set() and op == self.what and path.endswith(".safetensors"):
            if self.free == 0:
                print(f"stuck {os.getpid()}", flush=True)
                threading.Event().wait()  # until SIGKILL
            self.free -= 1


def main(root: str, mode: str) -> None:
    storage = StickyStorage(LocalStorage(root))
    cfg = CheckpointConfig(root=root, persist={"chunk_bytes": 4096, "workers": 1}, staging={"mode": "eager"},
                           retention={"keep_last": 1 if mode == "delete" else None})
    ckpt = Checkpointer(cfg, storage=storage)
    ckpt.save(STATE, step=1).wait(timeout=60)
    if mode == "hold":
        print(f"holding {os.getpid()}", flush=True)
        for line in sys.stdin:
            if line.strip() == "close":
                ckpt.close()
                print("closed", flush=True)
        return
    storage.what, storage.free = ("write", 1) if mode == "save" else ("delete", 1)
    storage.armed.set()
    ckpt.save(STATE, step=2)
    threading.Event().wait()  # the I/O or commit thread prints "stuck"; the test kills us


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
