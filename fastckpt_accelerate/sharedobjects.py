"""Accelerate's big files on S3 with several processes: every process uploads its parts of each one.

``model.safetensors`` (``pytorch_model.bin``) and ``optimizer.bin`` (and their ``_1``... siblings) are each ONE S3
object. On an ``s3://`` root with torch.distributed initialised (``shared_writes``, the default there), every
process saves each of them with the core's ``save_file(distributed=True)`` under ``checkpoint_N/<file>``: the
parameters and optimizer state (identical on every process under DDP) are split between the processes by bytes,
each uploads its byte ranges as parts of one multipart upload, the fixed bytes (header, pickle, zip directory) and
the buffers are process 0's parts, and process 0 completes the upload (``fastckpt/engine/sharedobject.py``).

The main process's ``save_files`` bundle then holds the big files as external members (``EXTERNAL``): it writes
the small files (scheduler, RNG states, ...) as before and, only once every big file is completed, the manifest
with each file's size and CRC32C (combined from the parts' CRC32Cs): the folder's commit point, last as before.
Any process's failure aborts the upload on every process (the earlier folders untouched), the bundle's commit then
fails and no manifest is written; an upload whose processes were all killed is aborted by the next start's sweep
(process 0's first shared upload under the root: markers in ``<root>/.fastckpt/uploads/``).

A lazy shared file commits once sealed on the training thread (the next ``optimizer.step()``, ``save_state``,
``wait_for_everyone``, ``end_training``): the main process's ``last_handle.wait()`` alone, with no step after the
save, would wait for that seal; wait with ``wait_for_everyone()``, as every process must.

Health is not measured in this mode (no process holds every tensor): ``load_state(healthy=True)`` finds no
measured folder and says so.
"""
from __future__ import annotations

import functools
import re
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

from accelerate import Accelerator

from fastckpt import CheckpointConfig, Checkpointer, RemoteOptions
from fastckpt.format.bundle import EXTERNAL

from .naming import CheckpointTarget, normalize
from .native import stock_files
from .watcher import OptimizerWatcher

__all__ = ["BIG_FILE", "SharedObjects", "shared_objects", "shares_objects", "without_health"]

# stock's model and optimizer files (model_1.safetensors, optimizer_1.bin, ... for further models/optimizers)
BIG_FILE = re.compile(r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin)$")


def shares_objects(root: str, shared_writes: bool) -> bool:
    """Whether the processes upload the parts of the big files of folders under ``root``: S3, shared writes."""
    return shared_writes and urlsplit(root).scheme in ("s3", "s3a")


def without_health(config: CheckpointConfig) -> CheckpointConfig:
    """The config of every Checkpointer in this mode: no process holds every tensor, so none measures health (a
    manifest's verdict over the small files alone would be a wrong answer)."""
    return replace(config, health=replace(config.health, enabled=False))


def shared_objects(root: str, shared_writes: bool, config: CheckpointConfig, storage: Any,
                   checkpointers: dict[str, Any], watchers: dict[str, Any]) -> tuple["SharedObjects | None",
                                                                                    CheckpointConfig]:
    """The owner's ``SharedObjects`` (None where the main process writes every file) and the config its own
    Checkpointers take."""
    if not shares_objects(root, shared_writes):
        return None, config
    config = without_health(config)
    return SharedObjects(config, storage, checkpointers, watchers), config


class SharedObjects:
    """Every process: the distributed Checkpointer of the root whose ``save_file`` uploads this process's parts."""

    KEY_SUFFIX = "#shared"  # its key among the owner's Checkpointers (waited for, closed and counted with them)

    def __init__(self, config: CheckpointConfig, storage: Any, checkpointers: dict[str, Any],
                 watchers: dict[str, Any]) -> None:
        self.root = normalize(config.root)
        self.key = f"{config.root}{self.KEY_SUFFIX}"
        self._config, self._storage = config, storage
        self._checkpointers, self._watchers = checkpointers, watchers

    def checkpointer(self) -> Checkpointer:
        """Built by every process at its first shared save (a collective: every process calls ``save_state``)."""
        if self.key not in self._checkpointers:
            # No remote tier: the main process's bundle mirrors the whole folder once its manifest is written.
            # Dedup as configured: each big file's records go under the root (<root>/.fastckpt/records/NAME.json,
            # never into the stock folder), so checkpoint_{N+1}/NAME copies from checkpoint_N/NAME
            # (format/rootrecords.py, engine/shareddedup.py).
            config = replace(self._config, remote=RemoteOptions(dedup=self._config.remote.dedup))
            ckpt = Checkpointer(config, storage=self._storage, distributed=True)
            # First among the owner's Checkpointers: wait() and close() go through them in order, and the main
            # process's bundle commits only after these files, whose lazy saves its wait() must seal first.
            others = dict(self._checkpointers)
            self._checkpointers.clear()
            self._checkpointers[self.key] = ckpt
            self._checkpointers.update(others)
            self._watchers[self.key] = OptimizerWatcher(ckpt)
        return self._checkpointers[self.key]

    def save(self, accelerator: Accelerator, target: CheckpointTarget, safe_serialization: bool,
             rngs: list[dict[str, Any]], step: int) -> dict[str, tuple[str, Any]] | None:
        """Every process, in file order: start the shared save of each big file of stock's files of ``target``;
        returns the files with those as external members for the main process's bundle (each waits for its file's
        commit and gives its size and CRC32C). None for a folder outside the root (the main process writes it)."""
        if target.root != self.root:
            return None
        files = stock_files(accelerator, target.url, safe_serialization, rngs)  # every process: the same big files
        folder = target.name
        ckpt = self.checkpointer()
        if any(n.startswith(f"{folder}/") for n in ckpt.pending_names()):
            # The same folder saved again while its last save is pending: the main process waits for that save's
            # commit before this one, which needs its shared files sealed (here, on the training thread, on every
            # process) or it would wait forever.
            ckpt.wait_staged()
        self._watchers[self.key].sync(accelerator._optimizers, accelerator._models)  # their tensors copied lazily
        out: dict[str, tuple[str, Any]] = {}
        for name, (kind, obj) in files.items():
            if BIG_FILE.match(name):
                handle = ckpt.save_file(obj, f"{folder}/{name}", step=step, kind=kind)
                out[name] = (EXTERNAL, functools.partial(_committed, handle))
            else:
                out[name] = (kind, obj)
        return out


def _committed(handle: Any) -> tuple[int, int | None]:
    """The main process's bundle, at its commit: the shared file's size and CRC32C once committed (or its error)."""
    info = handle.durable.result()  # not wait(): that seals, which only the training thread may do
    return info.nbytes, info.crc32c
