"""Which Accelerate engines ``enable()`` takes; the sharded ones are refused with what to use instead.

FSDP2 state is what the core saves best (each rank writes its DTensor blocks, ``load_into`` reshards), but
Accelerate 1.15 cannot run FSDP2 on CPU: ``AcceleratorState`` turns an ``fsdp_plugin`` into
``DistributedType.FSDP`` only for GPU-like devices (``accelerate/state.py``, the ``MULTI_GPU ... MULTI_NEURON``
branch), so on CPU the same script silently trains under DDP (``MULTI_CPU``). With no GPU to test on, the
hook does not claim FSDP2: its ``load_state`` restores full plain tensors with ``load_state_dict``, which
FSDP2's DTensor parameters do not take. The message says how to reach the core directly meanwhile.
"""

from __future__ import annotations

from typing import Any

from accelerate.utils import DistributedType

from fastckpt.errors import ConfigError

__all__ = ["check_engine"]

_SUPPORTED = "single-process training and DDP (MULTI_CPU, MULTI_GPU and the other MULTI_* data-parallel types)"

_FSDP2_INSTEAD = (
    "save FSDP2 state with the core instead: ckpt = fastckpt.Checkpointer(config, distributed=True) on every "
    "process, ckpt.save({'model': model.state_dict(), 'optim': optimizer.state_dict()}, step=...) writes each "
    "process's own blocks, and ckpt.load_into(...) of the same dict reshards on load (any number of processes); "
    "under Lightning, FastModelParallelStrategy does this"
)


def check_engine(accelerator: Any) -> None:
    """Raise ``ConfigError`` for an engine whose state fastckpt_accelerate cannot save; called by ``enable()``."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        if getattr(plugin, "fsdp_version", 1) == 2:
            raise ConfigError(
                f"fastckpt_accelerate does not support FSDP2 (fsdp_version=2) yet; it supports {_SUPPORTED}. "
                f"To checkpoint FSDP2 with fastckpt, {_FSDP2_INSTEAD}")
        raise ConfigError(
            f"fastckpt_accelerate does not support FSDP1 (fsdp_version=1): its FlatParameter/ShardedTensor state "
            f"is not what fastckpt stores; it supports {_SUPPORTED}. Move to fsdp_version=2, and {_FSDP2_INSTEAD}")
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise ConfigError(
            f"fastckpt_accelerate does not support distributed_type={kind.value}: its engine saves sharded state "
            f"itself; fastckpt supports {_SUPPORTED} (and FSDP2 through fastckpt.Checkpointer(distributed=True))")
