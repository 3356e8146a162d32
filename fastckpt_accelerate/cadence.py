"""``should_checkpoint(accelerator, step)``: when the training loop calls ``save_state()``, decided by the core's
cadence (``cadence.interval: auto`` (Young-Daly), N steps, or ``cadence.every_s``) from the YAML given to ``enable``.

Every process calls it at the same step; a decision that depends on a clock, and each new interval in steps, are
the main process's (``broadcast_object_list``), so every process calls ``save_state()`` together.
"""

from __future__ import annotations

import weakref
from typing import Any

from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from fastckpt import Cadence, CadenceStats, ConfigError, open_cadence, open_storage

from .checkpointing import FastAccelerateCheckpointing
from .enable import get_checkpointing
from .runend import at_end

__all__ = ["cadence_stats", "should_checkpoint"]


class _Trigger:
    def __init__(self, accelerator: Accelerator, checkpointing: FastAccelerateCheckpointing) -> None:
        options = checkpointing.config.cadence
        if options.interval is None and options.every_s is None:
            raise ConfigError("should_checkpoint() needs a cadence: set cadence.interval (steps or auto) or "
                              "cadence.every_s in the config given to fastckpt_accelerate.enable()")
        main = accelerator.is_main_process
        storage = open_storage(checkpointing.root, checkpointing.config.storage_options) if main else None
        agree = _agree if accelerator.num_processes > 1 else None
        self.cadence: Cadence
        self.cadence, self.runs = open_cadence(options, storage, agree=agree, record=main)
        if self.runs is not None and main:
            at_end(checkpointing, self.runs.end)  # end_training(): a clean end, not a failure
        self.seen = 0  # the main process's SaveStats already learnt from
        self.calls = 0

    def due(self, checkpointing: FastAccelerateCheckpointing, step: int | None) -> bool:
        stats = checkpointing.stats
        if len(stats) > self.seen:
            for st in stats[self.seen:]:
                self.cadence.observe_stats(st)
            self.seen = len(stats)
            if self.runs is not None:
                self.runs.seen()  # a save committed: this run was alive now
        self.calls += 1
        return self.cadence.should_save(self.calls if step is None else step)


def _agree(value: Any) -> Any:
    box = [value]
    broadcast_object_list(box, from_process=0)
    return box[0]


_TRIGGERS: "weakref.WeakKeyDictionary[FastAccelerateCheckpointing, _Trigger]" = weakref.WeakKeyDictionary()


def should_checkpoint(accelerator: Accelerator, step: int | None = None) -> bool:
    """Whether to call ``accelerator.save_state()`` now: call it once per step, after the step, on every process.

    ``step``: the training step (default: the number of calls). The cadence comes from the ``cadence`` section of
    the config given to ``enable()``; with ``interval: auto`` each save's measured stall (``SaveStats``) sets the
    next interval, sqrt(2 * cost * MTBF) (docs/CADENCE.md)."""
    checkpointing = get_checkpointing(accelerator)
    if checkpointing is None or checkpointing.closed:
        raise ConfigError("should_checkpoint() needs fastckpt enabled on this Accelerator: call "
                          "fastckpt_accelerate.enable(accelerator, config) first")
    trigger = _TRIGGERS.get(checkpointing)
    if trigger is None:
        trigger = _TRIGGERS[checkpointing] = _Trigger(accelerator, checkpointing)
    return trigger.due(checkpointing, step)


def cadence_stats(accelerator: Accelerator) -> CadenceStats | None:
    """What ``should_checkpoint`` chose and why (interval, measured cost, MTBF, the work a failure loses now beside
    at ``cadence.baseline_interval``); None before its first call."""
    checkpointing = get_checkpointing(accelerator)
    trigger = None if checkpointing is None else _TRIGGERS.get(checkpointing)
    return None if trigger is None else trigger.cadence.stats

