"""Which Accelerate engines ``enable()`` takes; the ones it cannot save are refused with what to use instead.

FSDP2 (``fsdp_version=2``) with ``SHARDED_STATE_DICT`` goes through ``fsdp2.FastFSDP2Checkpointing``: each
process writes its own DTensor blocks, ``load_state`` reshards. FSDP2 with ``FULL_STATE_DICT`` is refused: stock
gathers the full state onto the main process inside ``save_state``, which is the synchronous copy fastckpt exists
to avoid, and its loader expects that full file. Note that Accelerate 1.15 turns an ``fsdp_plugin`` into
``DistributedType.FSDP`` only on GPU-like devices (``accelerate/state.py``): on CPU the same script trains under
DDP (``MULTI_CPU``), and is saved as DDP.
"""

from __future__ import annotations

from typing import Any

from accelerate.utils import DistributedType

from fastckpt.errors import ConfigError

__all__ = ["check_engine", "is_sharded_fsdp2"]

_SUPPORTED = ("single-process training, DDP (MULTI_CPU, MULTI_GPU and the other MULTI_* data-parallel types) and "
              "FSDP2 with SHARDED_STATE_DICT")

_FSDP2_INSTEAD = (
    "FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type='SHARDED_STATE_DICT') saves through fastckpt "
    "(each process writes its own blocks, load_state reshards); the core does it too: "
    "fastckpt.Checkpointer(config, distributed=True) on every process, then save() and load_into()"
)


def check_engine(accelerator: Any) -> None:
    """Raise ``ConfigError`` for an engine whose state fastckpt_accelerate cannot save; called by ``enable()``."""
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        if getattr(plugin, "fsdp_version", 1) == 2:
            if _state_dict_type(plugin) == "SHARDED_STATE_DICT":
                return
            raise ConfigError(
                f"fastckpt_accelerate supports FSDP2 with state_dict_type=SHARDED_STATE_DICT only, not "
                f"{_state_dict_type(plugin)}: a full state dict is gathered onto the main process inside save_state, "
                "the synchronous copy fastckpt avoids. Set FullyShardedDataParallelPlugin(state_dict_type="
                "'SHARDED_STATE_DICT') (fastckpt reshards on load: any number of processes can resume it)")
        raise ConfigError(
            f"fastckpt_accelerate does not support FSDP1 (fsdp_version=1): its FlatParameter/ShardedTensor state "
            f"is not what fastckpt stores; it supports {_SUPPORTED}. Move to fsdp_version=2: {_FSDP2_INSTEAD}")
    if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
        raise ConfigError(
            f"fastckpt_accelerate does not support distributed_type={kind.value}: its engine saves sharded state "
            f"itself; fastckpt supports {_SUPPORTED}")


def is_sharded_fsdp2(accelerator: Any) -> bool:
    """Whether ``accelerator`` runs FSDP2 with sharded state dicts (what ``check_engine`` lets through as FSDP)."""
    return accelerator.distributed_type == DistributedType.FSDP


def _state_dict_type(plugin: Any) -> str:
    kind = getattr(plugin, "state_dict_type", None)
    return str(getattr(kind, "name", kind))
