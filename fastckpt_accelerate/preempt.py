"""Flush on preemption under Accelerate: the core's ``Preemption`` with ``accelerator.save_state()`` as the final
checkpoint.

Accelerate installs no signal handlers, so ours chain to whatever was there (the default action: the process then
dies of the signal as it would have). The safe point is the step pre-hook of every optimizer (torch's global
``register_optimizer_step_pre_hook``: Accelerate's ``AcceleratedOptimizer`` wraps the optimizer it steps, and may
be prepared after ``enable()``); the final checkpoint is ``accelerator.save_state()`` (its automatic naming, else
the folder ``{project_dir}/preempted``), then a wait for every pending save.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Optional

from accelerate import Accelerator
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fastckpt import Preemption, PreemptionOptions

__all__ = ["AcceleratePreemption", "PREEMPTED_DIR"]

PREEMPTED_DIR = "preempted"  # the final checkpoint's folder under project_dir without automatic naming


class AcceleratePreemption:
    """One enabled Accelerator's preemption handling; inert unless ``preemption.enabled``."""

    def __init__(self, options: PreemptionOptions, accelerator: Accelerator, checkpointing: Any) -> None:
        self.preemption: Optional[Preemption] = None
        self.path: Optional[str] = None  # the final checkpoint's folder (None with automatic naming)
        self._accelerator = weakref.ref(accelerator)
        self._checkpointing = weakref.ref(checkpointing)
        self._hook: Any = None
        if not options.enabled:
            return
        self.preemption = Preemption(options)
        self.preemption.on_preempt_run(self._final)
        self._hook = register_optimizer_step_pre_hook(_safe_point(self.preemption))

    def finish(self) -> None:
        """At ``end_training``, before the flush: the final checkpoint of a signal caught after the last step."""
        if self.preemption is not None:
            self.preemption.finish()

    def stop(self) -> None:
        """At ``end_training``, after the flush: remove the step hook, hand every signal caught on and restore the
        handlers we replaced."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.preemption is not None:
            self.preemption.close()

    def _final(self, timeout: float) -> None:
        accelerator, checkpointing = self._accelerator(), self._checkpointing()
        if accelerator is None or checkpointing is None:
            return
        if accelerator.project_configuration.automatic_checkpoint_naming:
            accelerator.save_state()
        else:
            self.path = os.path.join(accelerator.project_dir or os.getcwd(), PREEMPTED_DIR)
            accelerator.save_state(self.path)
        # unbounded, as the plugin's wait; the scheduler's SIGKILL bounds it (docs/accelerate.md)
        checkpointing.wait()


def _safe_point(preemption: Preemption) -> Any:
    def before_step(*_: Any) -> None:  # returns None: torch reads a pre-hook's return value as new (args, kwargs)
        preemption.point()

    return before_step
