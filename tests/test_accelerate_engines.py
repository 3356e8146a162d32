"""enable() refuses the engines whose state it cannot save, naming what is supported and what to use instead.

Accelerate 1.15 runs FSDP only on GPU-like devices (on CPU an fsdp_plugin silently yields MULTI_CPU), so these
accelerators are stand-ins carrying just what enable() reads first: the distributed type and the FSDP plugin.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from accelerate.utils import DistributedType

from fastckpt.errors import ConfigError
from fastckpt_accelerate import enable


def _accelerator(kind: DistributedType, fsdp_version: int | None = None,
                 state_dict_type: str = "SHARDED_STATE_DICT") -> SimpleNamespace:
    plugin = None if fsdp_version is None else SimpleNamespace(fsdp_version=fsdp_version,
                                                                 state_dict_type=SimpleNamespace(name=state_dict_type))
    return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin))


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "LOCAL_STATE_DICT"])
def test_fsdp2_without_sharded_state_dicts_is_refused(kind: str) -> None:
    # FSDP2 with SHARDED_STATE_DICT is taken (tests/test_accelerate_fsdp2.py); a full state dict is not.
    with pytest.raises(ConfigError, match=rf"FSDP2 with state_dict_type=SHARDED_STATE_DICT only, not {kind}"):
        enable(_accelerator(DistributedType.FSDP, 2, kind))


def test_fsdp1_is_refused_and_pointed_at_fsdp2() -> None:
    with pytest.raises(ConfigError, match=r"FSDP1 \(fsdp_version=1\).*Move to fsdp_version=2"):
        enable(_accelerator(DistributedType.FSDP, 1))


@pytest.mark.parametrize("kind", [DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA])
def test_other_sharding_engines_are_refused_naming_what_is_supported(kind: DistributedType) -> None:
    with pytest.raises(ConfigError, match=rf"distributed_type={kind.value}.*supports single-process.*DDP"):
        enable(_accelerator(kind))


@pytest.mark.parametrize("kwargs", [{"log_stats": True}, {"shared_writes": False}])
def test_fsdp2_refuses_the_options_it_cannot_honour(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="with FSDP2, log_stats=True and shared_writes=False are not supported"):
        enable(_accelerator(DistributedType.FSDP, 2), **kwargs)
