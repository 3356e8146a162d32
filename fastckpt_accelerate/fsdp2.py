"""``FastFSDP2Checkpointing``: ``save_state``/``load_state`` of an FSDP2 Accelerator through the core's DTensor path.

Stock Accelerate saves FSDP2 ``SHARDED_STATE_DICT`` state with torch.distributed.checkpoint (DCP) into
``pytorch_model_fsdp_{i}/`` and ``optimizer_{i}/`` folders, synchronously. Here every process snapshots its own
DTensor blocks (the live ones: no gather, no copy on the training thread) into one distributed core checkpoint,
and the main process commits it once every process's blocks are durable. The folder is therefore a core
checkpoint (``manifest.json`` + shards, docs/FORMAT.md), not DCP's layout: fastckpt does not write DCP's
``.metadata``. ``load_state`` reads both: a fastckpt folder reshards onto the current mesh (any number of
processes), a folder stock Accelerate wrote goes to stock ``load_state`` (DCP).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable

from accelerate import Accelerator

from fastckpt import CheckpointConfig, Checkpointer, RemoteOptions, is_checkpoint
from fastckpt.errors import CheckpointNotFoundError, ConfigError

from . import naming
from .distributed import all_gather
from .state import capture_process_state, restore_process_state
from .watcher import OptimizerWatcher, close_all, inner_optimizer

__all__ = ["FastFSDP2Checkpointing"]


def _options(strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Not cpu_offload, not full: the live DTensors (aliases of the parameters and optimizer state) are what
    # the core copies lazily, each process its own blocks.
    return StateDictOptions(full_state_dict=False, cpu_offload=False, strict=strict)


class FastFSDP2Checkpointing:
    """What ``enable()`` installs on an FSDP2 Accelerator (``fsdp_version=2``, ``SHARDED_STATE_DICT``)."""

    def __init__(self, accelerator: Accelerator, config: CheckpointConfig, *, storage: Any = None,
                 original_load_state: Callable[..., Any], original_wait_for_everyone: Callable[[], Any]) -> None:
        if storage is not None:
            raise ConfigError("storage= is not supported with FSDP2: every process opens the checkpoint folder "
                              "itself; pass a root URL in the config instead")
        if config.staging.shm:
            raise ConfigError("staging.shm does not apply to FSDP2 saves; set staging.shm: false")
        self._accelerator = accelerator
        self.config = config
        self.root = naming.normalize(config.root)
        self._original_load_state = original_load_state
        self._original_wait_for_everyone = original_wait_for_everyone
        self._checkpointers: dict[str, Checkpointer] = {}
        self._watchers: dict[str, OptimizerWatcher] = {}
        self._last_handle: Any | None = None
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether ``close()`` (or ``accelerator.end_training()``) ran."""
        return self._closed

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The distributed Checkpointer of the configured root, once a save or load used it (every process)."""
        return self._checkpointers.get(self.root)

    @property
    def last_handle(self) -> Any | None:
        """The ``SaveHandle`` of this process's latest save."""
        return self._last_handle

    @property
    def stats(self) -> list[Any]:
        """``SaveStats`` of this process's finished saves (its own blocks)."""
        return [s for ckpt in self._checkpointers.values() for s in ckpt.stats]

    # ----------------------------------------------------------------- save / load

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True,
                   **_: Any) -> str:
        """Every process: snapshot its DTensor blocks and return; the folder is committed once all are durable."""
        self._check_open()
        acc = self._accelerator
        project = acc.project_configuration
        if project.automatic_checkpoint_naming or output_dir is None:
            folder, name = self.root, f"checkpoint_{project.iteration}"
        else:
            folder, name = _split(os.fspath(output_dir))
        checkpointer = self._checkpointer_for(folder)  # collective on first use
        if checkpointer.exists(name):
            raise ConfigError(f"checkpoint folder {_join(folder, name)} already exists; pass another output_dir, "
                              "or set accelerator.project_configuration.iteration past it")
        self._watchers[folder].sync(acc._optimizers)
        state = self._live_state()
        state.update(
            iteration=project.iteration,
            step=acc.step,
            schedulers=[s.state_dict() for s in acc._schedulers],
            scaler=acc.scaler.state_dict() if acc.scaler is not None else None,
            custom=[obj.state_dict() for obj in acc._custom_objects],
            # each process's RNG and samplers, the same list on every process (rank 0 writes plain values)
            processes=all_gather(acc, capture_process_state(acc)),
        )
        self._last_handle = checkpointer.save(state, step=project.iteration, name=name)
        if project.automatic_checkpoint_naming:
            project.iteration += 1
        return _join(folder, name)

    def load_state(self, input_dir: str | os.PathLike | None = None, **kwargs: Any) -> None:
        """Every process: load a fastckpt folder into the live sharded model and optimizers (resharding onto the
        current mesh); a folder stock Accelerate wrote (DCP) goes to stock ``load_state``."""
        self._check_open()
        path = self._resolve(input_dir)
        if not is_checkpoint(path, self.config.storage_options):
            self._original_load_state(path, **kwargs)
            return
        self.wait()  # our own pending saves of it commit first
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        acc = self._accelerator
        folder, name = _split(path)
        target = self._live_state()
        loaded = self._checkpointer_for(folder).load_into(target, name=name)
        for model, state in zip(acc._models, loaded["models"]):
            set_model_state_dict(model, state, options=_options(kwargs.get("strict", True)))
        for model, opt, state in zip(acc._models, acc._optimizers, loaded["optimizers"]):
            set_optimizer_state_dict(model, inner_optimizer(opt), state, options=_options())
        for scheduler, state in zip(acc._schedulers, loaded.get("schedulers") or []):
            scheduler.load_state_dict(state)
        if acc.scaler is not None and loaded.get("scaler") is not None:
            acc.scaler.load_state_dict(loaded["scaler"])
        for obj, state in zip(acc._custom_objects, loaded.get("custom") or []):
            obj.load_state_dict(state)
        acc.step = int(loaded.get("step", 0))
        restore_process_state(acc, loaded)
        iteration = loaded.get("iteration")
        if isinstance(iteration, int):  # as for DDP: the next automatic save must not reuse the loaded name
            acc.project_configuration.iteration = iteration + 1

    # ----------------------------------------------------------------- lifecycle

    def wait(self) -> None:
        """Block until this process's pending saves are durable (and committed, on the main process)."""
        for ckpt in list(self._checkpointers.values()):
            ckpt.wait()

    def wait_for_everyone(self) -> None:
        """Replaces ``Accelerator.wait_for_everyone``: pending saves first, then stock's barrier."""
        if not self._closed:
            self.wait()
        self._original_wait_for_everyone()

    def close(self) -> None:
        """Flush pending saves and stop the Checkpointers; idempotent. Raises the first background error."""
        if self._closed:
            return
        self._closed = True
        first = close_all(self._checkpointers, self._watchers)
        self._checkpointers.clear()
        if first is not None:
            raise first

    # ----------------------------------------------------------------- helpers

    def _live_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        acc = self._accelerator
        if len(acc._optimizers) > len(acc._models):
            raise ConfigError(f"{len(acc._optimizers)} optimizers for {len(acc._models)} models: FSDP2 saves pair "
                              "optimizer i with model i, as stock Accelerate does; prepare one model per optimizer")
        return {"models": [get_model_state_dict(m, options=_options()) for m in acc._models],
                "optimizers": [get_optimizer_state_dict(m, inner_optimizer(o), options=_options())
                               for m, o in zip(acc._models, acc._optimizers)]}

    def _checkpointer_for(self, folder: str) -> Checkpointer:
        """One distributed Checkpointer per folder of checkpoints; its construction is collective."""
        if folder not in self._checkpointers:
            config = self.config
            if folder != self.root:  # retention and the remote tier belong to the configured root only
                retention = replace(config.retention, keep_last=None, keep_every_n_steps=None)
                config = replace(config, root=folder, retention=retention, remote=RemoteOptions())
            self._checkpointers[folder] = Checkpointer(config, distributed=True)
            self._watchers[folder] = OptimizerWatcher(self._checkpointers[folder])
        return self._checkpointers[folder]

    def _resolve(self, input_dir: str | os.PathLike | None) -> str:
        if input_dir is not None:
            return os.fspath(input_dir) if "://" in os.fspath(input_dir) else os.path.abspath(input_dir)
        self.wait()
        infos = self._checkpointer_for(self.root).list()
        if not infos:
            raise CheckpointNotFoundError(f"no committed checkpoint under {self.root}; pass input_dir")
        return _join(self.root, max(infos, key=lambda i: i.step).name)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("fastckpt was closed on this Accelerator (end_training() or close()); "
                              "call fastckpt_accelerate.enable() again")


def _split(path: str) -> tuple[str, str]:
    if "://" in path:
        folder, _, name = path.rstrip("/").rpartition("/")
        return folder, name
    return os.path.split(os.path.abspath(path))


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if "://" in folder else os.path.join(folder, name)
