"""``enable(accelerator, config)``: route one Accelerator's ``save_state``/``load_state`` through fastckpt.

Accelerate has no plugin slot for checkpointing (``kwargs_handlers`` is a closed mapping) and its save
pre-hook can take over only the model weights, so the methods are replaced on the instance. Other
Accelerators in the process are untouched. The replacements pickle (and deep-copy) as the stock methods: a
pickled Accelerator is what stock pickles, and its copy is a plain Accelerator (the threads and pending saves
stay with the original).
"""

from __future__ import annotations

import functools
from dataclasses import replace

from typing import Any, Callable

from accelerate import Accelerator

from fastckpt import Preemption
from fastckpt.errors import ConfigError

from .checkpointing import FastAccelerateCheckpointing
from .config import ConfigSource, resolve_config
from .fsdp import check_engine, is_sharded_fsdp2
from .fsdp2 import FastFSDP2Checkpointing
from .preempt import AcceleratePreemption
from .runend import ended

# The Accelerator methods enable() replaces on the instance.
_ROUTED = ("save_state", "load_state", "end_training", "wait_for_everyone")


def enable(
    accelerator: Accelerator,
    config: ConfigSource = None,
    *,
    storage: Any = None,
    log_stats: bool = False,
    shared_writes: bool | None = None,
    allow_unsafe_pickle: bool = False,
    complete_folders: bool = False,
) -> FastAccelerateCheckpointing:
    """Make ``accelerator.save_state()`` asynchronous and fastckpt-backed; call right after creating it.

    ``config`` is a fastckpt YAML path, a dict, a ``CheckpointConfig``, or None; a missing ``root`` means
    ``{project_dir}/checkpoints``. ``storage`` injects a ``fastckpt.Storage`` (tests). With ``log_stats``
    each save's stats go to ``accelerator.log`` at the next save, ``wait()`` or ``end_training()``.
    ``shared_writes`` (default: where possible; ``True`` raises where the processes could not share the root): on
    ``s3://`` with several processes every process uploads its parts of the model and optimizer files
    (``sharedobjects.py``); elsewhere the main process writes every file, as Accelerate does.
    ``allow_unsafe_pickle``: ``load_state`` of a folder written by Accelerate itself may unpickle its
    ``custom_checkpoint_*.pkl`` (and, with ``load_kwargs={"weights_only": False}``, other files) without
    restriction, as Accelerate does; off by default (such files load with ``weights_only=True``, anything
    else raises ``UnsafeCheckpointError``). Turn it on only for folders you trust.
    ``complete_folders`` (a local root): a new checkpoint folder is written under a hidden sibling name and appears
    under its own name only once committed, complete (a copy taken too early fails: no such folder); off by default,
    as in stock the folder exists once ``save_state()`` returns (docs/accelerate.md, "When the files are there").
    """
    check_engine(accelerator)
    previous = get_checkpointing(accelerator)
    if previous is not None and not previous.closed:
        raise ConfigError("fastckpt is already enabled on this Accelerator; close() the returned object first")
    if is_sharded_fsdp2(accelerator):
        if complete_folders:
            raise ConfigError("complete_folders=True is not supported with FSDP2: every process writes its own blocks "
                              "into the folder; copy a folder only once it holds manifest.json")
        if log_stats or shared_writes is False:
            raise ConfigError("with FSDP2, log_stats=True and shared_writes=False are not supported: every process "
                              "writes its own blocks; read checkpointing.stats instead of log_stats")
        fsdp2 = FastFSDP2Checkpointing(
            accelerator, resolve_config(config, accelerator), storage=storage,
            original_load_state=type(accelerator).load_state.__get__(accelerator),
            original_wait_for_everyone=type(accelerator).wait_for_everyone.__get__(accelerator))
        _install(accelerator, fsdp2)  # type: ignore[arg-type]  # the same routed surface
        return fsdp2  # type: ignore[return-value]
    resolved = resolve_config(config, accelerator)
    Preemption.check_installable(resolved.preemption)  # refused before any Checkpointer starts its threads
    checkpointing = FastAccelerateCheckpointing(
        accelerator,
        # preemption is handled once per Accelerator (below), not by each folder's Checkpointer
        replace(resolved, preemption=replace(resolved.preemption, enabled=False)),
        storage=storage,
        log_stats=log_stats,
        shared_writes=shared_writes,
        original_load_state=type(accelerator).load_state.__get__(accelerator),
        allow_unsafe_pickle=allow_unsafe_pickle,
        complete_folders=complete_folders,
        original_wait_for_everyone=type(accelerator).wait_for_everyone.__get__(accelerator),
    )
    _install(accelerator, checkpointing)
    checkpointing.preemption = AcceleratePreemption(resolved.preemption, accelerator, checkpointing)
    return checkpointing


def get_checkpointing(accelerator: Accelerator) -> FastAccelerateCheckpointing | None:
    """The object ``enable`` attached to ``accelerator``, if any (None on a pickled copy: see ``_Routed``)."""
    routed = vars(accelerator).get("save_state")
    return routed.checkpointing if isinstance(routed, _Routed) else None


class _Routed:
    """One Accelerator method routed through fastckpt, set on the instance by ``enable``.

    A module-level class rather than a closure or a bound method of the checkpointing object, so that the
    Accelerator still pickles (Accelerate's own tests pickle it, ``ddp_spawn``-like launchers and
    ``copy.deepcopy`` do too): it reduces to the stock method of the copy, so the copy is a plain Accelerator, as
    stock pickles it. The checkpointing object (threads, locks, pending saves) is process state and never travels.
    """

    def __init__(self, accelerator: Accelerator, name: str, checkpointing: FastAccelerateCheckpointing,
                 call: Callable[..., Any]) -> None:
        self._accelerator, self._name, self.checkpointing, self._call = accelerator, name, checkpointing, call
        self.__doc__ = getattr(type(accelerator), name).__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        return _stock_method, (self._accelerator, self._name)

    def __repr__(self) -> str:
        return f"<{type(self._accelerator).__name__}.{self._name} routed through fastckpt>"


def _stock_method(accelerator: Accelerator, name: str) -> Callable[..., Any]:
    """What a routed method unpickles to: the class's own method, bound to the copy."""
    return getattr(type(accelerator), name).__get__(accelerator)


def _end_training(checkpointing: FastAccelerateCheckpointing, original: Callable[[], None]) -> None:
    # Flush before the process group is destroyed and the trackers finish.
    preemption = getattr(checkpointing, "preemption", None)
    if preemption is not None:
        preemption.finish()  # a signal caught after the last step: its final checkpoint, while saves are accepted
    try:
        checkpointing.close()
        ended(checkpointing)  # a clean end (the record of runs of the cadence)
    finally:
        try:
            original()
        finally:
            if preemption is not None:
                preemption.stop()  # once flushed and ended: every signal caught goes on (it may end the process)


def _install(accelerator: Accelerator, checkpointing: FastAccelerateCheckpointing) -> None:
    calls: dict[str, Callable[..., Any]] = {
        "save_state": checkpointing.save_state,
        "load_state": checkpointing.load_state,
        "end_training": functools.partial(_end_training, checkpointing, _stock_method(accelerator, "end_training")),
        "wait_for_everyone": checkpointing.wait_for_everyone,  # pending saves commit first
    }
    for name in _ROUTED:
        setattr(accelerator, name, _Routed(accelerator, name, checkpointing, calls[name]))
