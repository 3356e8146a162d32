"""One Lightning checkpoint folder: a core ``Checkpointer`` for the data and pointer files for the names.

Layout of ``dirpath`` (local or remote)::

    epoch=0-step=10.ckpt                              pointer -> [weights-1f2e, state-3d4c]
    epoch=0-step=10.ckpt.weights-1f2e3d4c.fastckpt/   core checkpoint: state_dict + optimizer_states
    epoch=0-step=10.ckpt.state-3d4c5b6a.fastckpt/     core checkpoint: loops, callbacks, hparams...
    last.ckpt                                         pointer -> [epoch=0-step=10.ckpt.weights-1f2e,
                                                                  last.ckpt.state-9a8b]  (same step: shared)
    last.ckpt.state-9a8b7c6d.fastckpt/

Data folders get a fresh token on every save, so a data folder is never replaced while a pointer names it. Data is
deleted only when no pointer in the folder names it any more (a reference count that survives restarts, because it
is recomputed from the pointers on disk) and no queued pointer will.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fastckpt import Checkpointer, CheckpointConfig, SaveHandle
from fastckpt.errors import IntegrityError
from torch.optim import Optimizer

from fastckpt_lightning.config import for_directory
from fastckpt_lightning.pointer import DATA_SUFFIX, Pointer, PointerStore

log = logging.getLogger("fastckpt")

CheckpointerFactory = Callable[[CheckpointConfig], Checkpointer]


def data_name(basename: str, kind: str) -> str:
    """A fresh data folder name for the ``kind`` part of the checkpoint Lightning calls ``basename``."""
    return f"{basename}.{kind}-{uuid.uuid4().hex[:8]}{DATA_SUFFIX}"


class CheckpointFolder:
    """Saves, publishes and removes the checkpoints of one folder."""

    def __init__(self, folder: str, config: CheckpointConfig, make_checkpointer: CheckpointerFactory) -> None:
        self.folder = folder
        self.checkpointer = make_checkpointer(for_directory(config, folder))
        self.pointers = PointerStore(self.checkpointer.storage)
        self._lock = threading.Lock()
        # Parts named by pointers that are queued but not written yet: garbage collection must not delete them.
        self._reserved: Counter[str] = Counter()
        self._watches: list[Any] = []

    def watch(self, optimizers: Sequence[tuple[Optimizer, bool]]) -> None:
        """Make exactly these optimizers' tensors lazy-safe; ``bool`` asks for torch's step pre-hook too."""
        self.unwatch()
        self._watches = [self.checkpointer.watch(optimizer, hook=hook) for optimizer, hook in optimizers]

    def unwatch(self) -> None:
        """Forget every watched optimizer."""
        watches, self._watches = self._watches, []
        for watch in watches:
            watch.remove()

    def save(self, state: dict[str, Any], step: int, basename: str, kind: str) -> SaveHandle:
        """Snapshot ``state`` into a fresh data folder for the ``kind`` part of ``basename``; returns at once."""
        return self.checkpointer.save(state, step, name=data_name(basename, kind))

    def reserve(self, parts: Iterable[str]) -> None:
        """Protect ``parts`` from garbage collection until their pointer is published. Called before queueing it."""
        with self._lock:
            self._reserved.update(parts)

    def publish(self, basename: str, pointer: Pointer, handles: Sequence[SaveHandle]) -> None:
        """Wait until the data is committed, then point ``basename`` at it. Runs on the publisher thread."""
        try:
            for handle in handles:
                # A failed save raises here, so no pointer ever names uncommitted data.
                handle.wait()
            previous = self._read(basename)
            self.pointers.write(basename, pointer)
        finally:
            self._release(pointer.parts)
        if previous is not None:
            self._collect(set(previous.parts) - set(pointer.parts))

    def unpublish(self, basename: str) -> None:
        """Delete the pointer ``basename`` and any data only it named. Runs on the publisher thread."""
        pointer = self._read(basename)
        # Also removes a legacy single-file checkpoint of that name, as TorchCheckpointIO would.
        self.pointers.delete(basename)
        if pointer is not None:
            self._collect(set(pointer.parts))

    def close(self) -> None:
        """Flush and stop the core checkpointer. Idempotent."""
        self.unwatch()
        self.checkpointer.close()

    def _read(self, basename: str) -> Pointer | None:
        """The pointer about to be replaced or removed; a crafted one is replaced, and names nothing to collect."""
        try:
            return self.pointers.read(basename)
        except IntegrityError as e:
            log.warning("fastckpt: replacing the malformed pointer %s without collecting its data: %s", basename, e)
            return None

    def _release(self, parts: Iterable[str]) -> None:
        with self._lock:
            self._reserved.subtract(parts)
            self._reserved = +self._reserved  # drop the zero counts

    def _collect(self, candidates: set[str]) -> None:
        if not candidates:
            return
        live = self.pointers.referenced_parts()
        with self._lock:
            live |= set(self._reserved)
        for part in sorted(candidates - live):
            # The core deletes in order behind its pending saves; waiting here keeps our queue in the same order.
            self.checkpointer.delete(part).result()
