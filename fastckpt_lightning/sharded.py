"""``FastModelParallelStrategy`` (FSDP2, tensor parallelism) and ``FastFSDPStrategy`` (FSDP1) saving through fastckpt.

The plugin alone cannot reach sharded state: ``ModelParallelStrategy.save_checkpoint`` runs on every rank and calls
DCP directly, never ``CheckpointIO``, and it builds its state dicts with ``cpu_offload=True`` (a synchronous copy of
every shard, and on GPU a device-to-host copy on the training thread). This subclass keeps everything else and
changes three things when ``save_distributed_checkpoint=True`` (the default):

- the state dicts hold the live DTensors (``cpu_offload=False``), so the core stages each rank's local blocks lazily
  behind the next forward/backward, with no gather and no copy inside ``save_checkpoint``;
- every rank writes its own blocks through one distributed core ``Checkpointer`` per folder, and rank 0 commits once;
  the checkpoint is a folder under the name Lightning chose (``epoch=0-step=10.ckpt/``), as Lightning's own sharded
  checkpoints are;
- loading reads, on each rank, only the blocks overlapping its own, so a checkpoint resumes on another world size or
  mesh. Folders written by stock Lightning (DCP) and single files still load through the parent class.

``save_distributed_checkpoint=False`` (one full file on rank 0) is left to the parent and the plugin.

``FastFSDPStrategy`` does the same for ``FSDPStrategy(state_dict_type="sharded")`` (which calls DCP directly too).
FSDP1 gives its sharded state as DTensors only when it was wrapped with a ``device_mesh`` (else as
``ShardedTensor``s, which the core does not save), so the strategy passes a 1-D mesh over the world when none is
given. FSDP1's sharded state dict is built from clones of each rank's chunk (torch's ``_create_chunk_dtensor``),
so that copy happens on the training thread, as with stock; writing stays in the background.
``state_dict_type="full"`` is left to the parent and the plugin.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from fastckpt import is_checkpoint
from fastckpt.errors import ConfigError
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.optim import Optimizer

from fastckpt_lightning.owner import FastIOOwner

__all__ = ["FastFSDPStrategy", "FastModelParallelStrategy"]


def _sharded_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Not cpu_offload: the live DTensors (aliases of the parameters and optimizer state) are what the core
    # copies lazily; an offloaded copy would be taken synchronously, on the training thread.
    return StateDictOptions(full_state_dict=False, cpu_offload=False)


class _ShardedThroughCore(FastIOOwner):
    """The save, load and removal of sharded state through the core, for a strategy whose model is sharded."""

    def _sharded(self) -> bool:
        """Whether this strategy saves sharded state (else the parent's full-state path runs)."""
        raise NotImplementedError

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's live sharded DTensors (called on every rank by ``Trainer.save_checkpoint``)."""
        if not self._sharded():
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        return get_model_state_dict(self.model, options=_sharded_options())

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's live sharded state, keyed by parameter name (called on every rank)."""
        if not self._sharded():
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.model is not None
        return get_optimizer_state_dict(self.model, optimizer, options=_sharded_options())

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Every rank: snapshot its blocks and return; the folder appears committed once every rank's are durable."""
        if not self._sharded():
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        self.refuse_storage_options(storage_options)
        path = os.fspath(self.broadcast(os.fspath(filepath)))  # rank 0 names it, as in the parent class
        assert self.lightning_module is not None
        self.fast_io.save_sharded(checkpoint, path, self.lightning_module.trainer)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Every rank: load a fastckpt folder into the live model and optimizers (resharding), else defer to DCP."""
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        if not is_checkpoint(path, self.fast_io.config.storage_options):
            return super().load_checkpoint(path, weights_only=weights_only)
        from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict, get_model_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        assert self.model is not None and self.lightning_module is not None
        options = _sharded_options()
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        target = {"state_dict": get_model_state_dict(self.model, options=options),
                  "optimizer_states": [get_optimizer_state_dict(self.model, o, options=options) for o in optimizers]}
        checkpoint = self.fast_io.load_sharded(path, target)
        strict = self.lightning_module.strict_loading
        set_model_state_dict(self.model, checkpoint["state_dict"],
                             options=_with_strict(options, strict))
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", [])):
            set_optimizer_state_dict(self.model, optimizer, state, options=options)
        return checkpoint

    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Rank 0: delete a sharded folder behind the saves queued before it (``ModelCheckpoint(save_top_k)``)."""
        if not self._sharded():
            return super().remove_checkpoint(filepath)
        if self.is_global_zero:
            self.fast_io.remove_sharded(os.fspath(filepath))

    def teardown(self) -> None:
        """The parent's, then the plugin's teardown (flush, close its Checkpointers, raise a background error once).

        ``Strategy.teardown`` ends with ``checkpoint_io.teardown()``, but ``ModelParallelStrategy`` and
        ``FSDPStrategy`` replace it without calling it: the plugin's Checkpointers stayed open after ``fit``, holding
        the checkpoint root's lock, so a second Trainer of the same folder in this process (``validate``/``test``
        with ``ckpt_path``) was refused as "in use by another writer" (this very process)."""
        try:
            super().teardown()
        finally:
            self.checkpoint_io.teardown()


class FastModelParallelStrategy(_ShardedThroughCore, ModelParallelStrategy):
    """``Trainer(strategy=FastModelParallelStrategy(...), plugins=[FastCheckpointIO(...)])``; same arguments as
    ``ModelParallelStrategy``. Without a ``FastCheckpointIO`` plugin, one with default settings is used."""

    def _sharded(self) -> bool:
        return bool(self._save_distributed_checkpoint)


class FastFSDPStrategy(_ShardedThroughCore, FSDPStrategy):
    """``Trainer(strategy=FastFSDPStrategy(state_dict_type="sharded", ...), plugins=[FastCheckpointIO(...)])``;
    same arguments as ``FSDPStrategy``. Without a ``device_mesh``, the model is sharded over a 1-D mesh of every
    rank (FSDP1 then gives DTensors, which the core saves); with ``state_dict_type="full"``, the parent's path."""

    def _sharded(self) -> bool:
        return self._state_dict_type == "sharded"

    def setup_environment(self) -> None:
        """The parent's, then a 1-D device mesh over the world unless the user passed one (sharded state only)."""
        super().setup_environment()
        if self._sharded() and self.kwargs.get("device_mesh") is None:
            # FSDP1 takes a mesh or a process group, not both; a hybrid strategy needs a 2-D mesh. Without a mesh
            # its sharded state is ShardedTensors, which the core does not save: refuse rather than fail at save.
            if self.kwargs.get("process_group") is not None or "HYBRID" in self.sharding_strategy.name:
                raise ConfigError(
                    f"FastFSDPStrategy(state_dict_type='sharded') with sharding_strategy={self.sharding_strategy.name}"
                    " and no device_mesh: FSDP1 gives DTensor state (what fastckpt saves) only on a device mesh; "
                    "pass device_mesh=(replicas, shards) instead of process_group")
            from torch.distributed.device_mesh import init_device_mesh

            self.kwargs["device_mesh"] = init_device_mesh(self.root_device.type, (self.world_size,))


def _with_strict(options: Any, strict: bool) -> Any:
    import dataclasses

    return dataclasses.replace(options, strict=strict)
