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


def _accelerator(kind: DistributedType, fsdp_version: int | None = None) -> SimpleNamespace:
    plugin = None if fsdp_version is None else SimpleNamespace(fsdp_version=fsdp_version)
    return SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin))


def test_fsdp2_is_refused_with_the_core_route() -> None:
    with pytest.raises(ConfigError, match=r"FSDP2 \(fsdp_version=2\).*supports single-process.*DDP") as e:
        enable(_accelerator(DistributedType.FSDP, 2))
    assert "Checkpointer(config, distributed=True)" in str(e.value) and "load_into" in str(e.value)
    assert "FastModelParallelStrategy" in str(e.value)


def test_fsdp1_is_refused_and_pointed_at_fsdp2() -> None:
    with pytest.raises(ConfigError, match=r"FSDP1 \(fsdp_version=1\).*Move to fsdp_version=2"):
        enable(_accelerator(DistributedType.FSDP, 1))


@pytest.mark.parametrize("kind", [DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA])
def test_other_sharding_engines_are_refused_naming_what_is_supported(kind: DistributedType) -> None:
    with pytest.raises(ConfigError, match=rf"distributed_type={kind.value}.*supports single-process.*DDP"):
        enable(_accelerator(kind))
