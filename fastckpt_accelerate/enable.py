"""``enable(accelerator, config)``: route one Accelerator's ``save_state``/``load_state`` through fastckpt.

Accelerate has no plugin slot for checkpointing (``kwargs_handlers`` is a closed mapping) and its save
pre-hook can take over only the model weights, so the methods are replaced on the instance. Other
Accelerators in the process are untouched.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from fastckpt.errors import ConfigError

from .checkpointing import FastAccelerateCheckpointing
from .config import ConfigSource, resolve_config
from .fsdp import check_engine

_ATTRIBUTE = "_fastckpt_checkpointing"


def enable(
    accelerator: Accelerator,
    config: ConfigSource = None,
    *,
    storage: Any = None,
    log_stats: bool = False,
    shared_writes: bool | None = None,
    allow_unsafe_pickle: bool = False,
) -> FastAccelerateCheckpointing:
    """Make ``accelerator.save_state()`` asynchronous and fastckpt-backed; call right after creating it.

    ``config`` is a fastckpt YAML path, a dict, a ``CheckpointConfig``, or None; a missing ``root`` means
    ``{project_dir}/checkpoints``. ``storage`` injects a ``fastckpt.Storage`` (tests). With ``log_stats``
    each save's stats go to ``accelerator.log`` at the next save, ``wait()`` or ``end_training()``.
    ``shared_writes``: accepted and validated (``True`` raises where the processes could not share the
    root), but in Accelerate's native format the main process writes every file, as Accelerate does.
    ``allow_unsafe_pickle``: ``load_state`` of a folder written by Accelerate itself may unpickle its
    ``custom_checkpoint_*.pkl`` (and, with ``load_kwargs={"weights_only": False}``, other files) without
    restriction, as Accelerate does; off by default (such files load with ``weights_only=True``, anything
    else raises ``UnsafeCheckpointError``). Turn it on only for folders you trust.
    """
    check_engine(accelerator)
    previous = getattr(accelerator, _ATTRIBUTE, None)
    if previous is not None and not previous.closed:
        raise ConfigError("fastckpt is already enabled on this Accelerator; close() the returned object first")
    checkpointing = FastAccelerateCheckpointing(
        accelerator,
        resolve_config(config, accelerator),
        storage=storage,
        log_stats=log_stats,
        shared_writes=shared_writes,
        original_load_state=type(accelerator).load_state.__get__(accelerator),
        allow_unsafe_pickle=allow_unsafe_pickle,
        original_wait_for_everyone=type(accelerator).wait_for_everyone.__get__(accelerator),
    )
    _install(accelerator, checkpointing)
    return checkpointing


def get_checkpointing(accelerator: Accelerator) -> FastAccelerateCheckpointing | None:
    """The object ``enable`` attached to ``accelerator``, if any."""
    return getattr(accelerator, _ATTRIBUTE, None)


def _install(accelerator: Accelerator, checkpointing: FastAccelerateCheckpointing) -> None:
    original_end_training = type(accelerator).end_training.__get__(accelerator)

    def end_training() -> None:
        # Flush before the process group is destroyed and the trackers finish.
        try:
            checkpointing.close()
        finally:
            original_end_training()

    accelerator.save_state = checkpointing.save_state
    accelerator.load_state = checkpointing.load_state
    accelerator.end_training = end_training
    accelerator.wait_for_everyone = checkpointing.wait_for_everyone  # pending saves commit first
    setattr(accelerator, _ATTRIBUTE, checkpointing)
