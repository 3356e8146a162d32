"""Everything ``Accelerator.save_state`` saves, as one nested state for ``Checkpointer.save``, and back.

Layout of a checkpoint (format 1)::

    meta        iteration, step, number of processes, format version
    models      unwrapped ``state_dict()`` per prepared model (no DDP "module." prefix: portable)
    optimizers  ``state_dict()`` per prepared optimizer
    schedulers  ``state_dict()`` per prepared scheduler
    scaler      the GradScaler's ``state_dict()`` or None
    custom      ``state_dict()`` per object given to ``register_for_checkpointing``
    processes   one entry per process, by process index: RNG states and dataloader positions

The replicated parts are written once, by the main process; ``processes`` is gathered to it.
The dicts hold live aliases of parameters and optimizer state: the core copies those lazily, before the
next ``optimizer.step()``, and copies every other tensor eagerly inside ``save()``.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator

from fastckpt.errors import StateMismatchError

from .dataloaders import capture_dataloader_state, restore_dataloader_state
from .rng import capture_rng_states, restore_rng_states

FORMAT_VERSION = 1
META_KEY = "fastckpt_accelerate"


def capture_process_state(accelerator: Accelerator) -> dict[str, Any]:
    """The state that differs between processes; small, so it can travel through ``all_gather_object``."""
    return {
        "rng": capture_rng_states(),
        "dataloaders": [capture_dataloader_state(dl) for dl in accelerator._dataloaders],
    }


def capture_state(accelerator: Accelerator, iteration: int, processes: list[dict[str, Any]]) -> dict[str, Any]:
    """The full checkpoint state of ``accelerator`` (main process), holding live tensor aliases."""
    return {
        META_KEY: {
            "format": FORMAT_VERSION,
            "iteration": iteration,
            "step": accelerator.step,
            "num_processes": accelerator.num_processes,
        },
        "models": [_unwrap(accelerator, m).state_dict() for m in accelerator._models],
        "optimizers": [opt.state_dict() for opt in accelerator._optimizers],
        "schedulers": [sched.state_dict() for sched in accelerator._schedulers],
        "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
        "custom": [obj.state_dict() for obj in accelerator._custom_objects],
        "processes": processes,
    }


def read_meta(state: dict[str, Any], path: str) -> dict[str, Any]:
    """The meta block of a loaded checkpoint; raises if ``path`` was not written by this integration."""
    meta = state.get(META_KEY) if isinstance(state, dict) else None
    if not isinstance(meta, dict) or "iteration" not in meta:
        raise StateMismatchError(
            f"{path} is a fastckpt checkpoint but was not written by fastckpt_accelerate (no {META_KEY!r} block); "
            "load it with fastckpt.load_checkpoint() and restore the parts yourself"
        )
    if int(meta.get("format", 0)) > FORMAT_VERSION:
        raise StateMismatchError(
            f"{path} uses fastckpt_accelerate format {meta['format']}, newer than this version "
            f"({FORMAT_VERSION}); upgrade fastckpt"
        )
    return meta


def restore_state(
    accelerator: Accelerator, state: dict[str, Any], path: str, **load_model_kwargs: Any
) -> None:
    """Load every part of ``state`` into the objects prepared on ``accelerator`` (any process)."""
    _check_counts(accelerator, state, path)
    for model, model_state in zip(accelerator._models, state["models"]):
        _unwrap(accelerator, model).load_state_dict(model_state, **load_model_kwargs)
    for opt, opt_state in zip(accelerator._optimizers, state["optimizers"]):
        opt.load_state_dict(opt_state)
    for sched, sched_state in zip(accelerator._schedulers, state["schedulers"]):
        sched.load_state_dict(sched_state)
    if accelerator.scaler is not None and state.get("scaler") is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    for obj, obj_state in zip(accelerator._custom_objects, state["custom"]):
        obj.load_state_dict(obj_state)


def restore_process_state(accelerator: Accelerator, state: dict[str, Any]) -> bool:
    """Restore this process's RNG and dataloader states; False if the checkpoint has none for it."""
    processes = state.get("processes") or []
    index = accelerator.process_index
    if index >= len(processes):
        # Resuming on more processes than saved: the new ranks keep their seeds (Accelerate does the same
        # when random_states_{rank}.pkl is missing).
        return False
    mine = processes[index]
    restore_rng_states(mine["rng"])
    for dataloader, dl_state in zip(accelerator._dataloaders, mine["dataloaders"]):
        restore_dataloader_state(dataloader, dl_state)
    return True


def _unwrap(accelerator: Accelerator, model: Any) -> Any:
    # Unwrapped keys (no "module." or "_orig_mod.") let a checkpoint from 2 processes resume on 1.
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def _check_counts(accelerator: Accelerator, state: dict[str, Any], path: str) -> None:
    expected = {
        "models": len(accelerator._models),
        "optimizers": len(accelerator._optimizers),
        "schedulers": len(accelerator._schedulers),
        "custom": len(accelerator._custom_objects),
    }
    found = {key: len(state.get(key) or []) for key in expected}
    if found != expected:
        raise StateMismatchError(
            f"{path} holds {found} but the accelerator has {expected} prepared/registered; prepare the same "
            "models, optimizers and schedulers and register the same objects (in the same order) before load_state()"
        )

