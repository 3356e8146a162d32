"""Which epoch and phase boundaries need finished lazy copies: those where a callback or the module may write weights.

Lazy copies are safe while parameters change only in ``optimizer.step()``. At epoch and phase boundaries
(``on_fit_start`` ... ``on_train_epoch_start``/``_end`` ... ``on_fit_end``) Lightning's own callbacks write them
elsewhere: ``StochasticWeightAveraging`` copies the averaged weights into the live parameters when its BatchNorm
epoch starts, ``WeightAveraging`` swaps them around validation, ``ModelPruning`` rebinds them (lottery ticket),
``BaseFinetuning`` unfreezes modules into the optimizer; a user's callback or ``LightningModule`` hook may do
anything. So the companion callback, which runs first in every hook, waits for pending copies at a boundary hook
when any code that will run in it may write weights: a callback or the module that implements the hook, unless
the implementation is one of the stock callbacks below that only read (``ModelCheckpoint``, progress bars, ...).

Waiting everywhere would be simpler and always safe, but a checkpoint saved at the end of an epoch would then lose
its overlap with training entirely (the next boundary follows at once): the most common checkpoint would cost a
full copy stall. Waiting only where a writer runs keeps that overlap, and costs nothing per step: batch hooks are
never boundaries (the wait before ``optimizer.step()`` covers what the step changes).

User code at a boundary (``user_code``: the module's override, a callback that is not Lightning's) may also read
the files saved before it, as it can in stock Lightning; there the companion waits for the pending saves
themselves unless ``FastCheckpointIO(async_user_hooks=True)``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden

__all__ = ["BOUNDARY_HOOKS", "user_code", "writers"]

# The callback hooks that run at an epoch or phase boundary of a fit, in which Lightning's callbacks write weights.
# Not the batch hooks (per step), not on_validation_start/on_train_end/on_exception (the companion waits there
# always), not the checkpoint hooks (they run inside a save, which snapshots what they produce).
BOUNDARY_HOOKS = (
    "on_fit_start",
    "on_sanity_check_start",
    "on_sanity_check_end",
    "on_train_start",
    "on_train_epoch_start",
    "on_train_epoch_end",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_fit_end",
)

# Stock callbacks whose hooks read the model but never write its parameters or optimizer state. Their own hook
# implementations are exempt; a subclass that overrides a hook is not (its code may write).
_READ_ONLY = (
    "lightning.pytorch.callbacks.ModelCheckpoint",  # FastModelCheckpoint inherits its hooks
    "lightning.pytorch.callbacks.EarlyStopping",
    "lightning.pytorch.callbacks.progress.ProgressBar",
    "lightning.pytorch.callbacks.TQDMProgressBar",
    "lightning.pytorch.callbacks.RichProgressBar",
    "lightning.pytorch.callbacks.ModelSummary",
    "lightning.pytorch.callbacks.RichModelSummary",
    "lightning.pytorch.callbacks.LearningRateMonitor",
    "lightning.pytorch.callbacks.Timer",
    "lightning.pytorch.callbacks.ThroughputMonitor",
    "lightning.pytorch.callbacks.DeviceStatsMonitor",
    "lightning.pytorch.callbacks.GradientAccumulationScheduler",
    "lightning.pytorch.callbacks.SpikeDetection",
    "lightning.pytorch.callbacks.OnExceptionCheckpoint",
)

# Single hooks of stock writers that write no weight a checkpoint holds lazily, where a wait would cost the overlap
# of every epoch-end checkpoint: SWA's epoch end only resets a loop flag; WeightAveraging's updates its averaged
# copy, whose tensors are no optimizer's, so a save copies them inside save_checkpoint (eagerly).
_READ_ONLY_HOOKS = {
    "lightning.pytorch.callbacks.StochasticWeightAveraging": ("on_train_epoch_end",),
    "lightning.pytorch.callbacks.WeightAveraging": ("on_train_epoch_end",),
}


def writers(trainer: pl.Trainer, pl_module: Optional[pl.LightningModule], hook: str,
            companion: Callback) -> list[str]:
    """Who may write weights in ``hook`` (class names; the module as ``LightningModule``): empty when every
    implementation that runs there is a read-only stock callback's, or Lightning's no-op default."""
    found = [type(callback).__qualname__ for callback in trainer.callbacks
             if callback is not companion and _may_write(callback, hook)]
    if pl_module is not None and is_overridden(hook, pl_module):
        found.append(type(pl_module).__qualname__)
    return found


def user_code(trainer: pl.Trainer, pl_module: Optional[pl.LightningModule], hook: str,
              companion: Callback) -> list[str]:
    """Whose own code runs in ``hook`` (class names): the module's override, and callbacks whose implementation is
    not Lightning's. Such code may read the checkpoint files saved before the hook (``os.listdir``, a copy, an
    upload), as it can in stock Lightning; Lightning's own callbacks never do."""
    found = [type(callback).__qualname__ for callback in trainer.callbacks
             if callback is not companion and _users(getattr(callback, hook, None))]
    if pl_module is not None and is_overridden(hook, pl_module) and _users(getattr(pl_module, hook, None)):
        found.append(type(pl_module).__qualname__)
    return found


def _users(method: Any) -> bool:
    implementation = _function(method)
    # Lightning's callbacks (``Callback``'s no-ops included) and this plugin's own never read checkpoint files.
    return implementation is not None and not getattr(implementation, "__module__", "").startswith(_OURS)


_OURS = ("lightning.", "pytorch_lightning.", "fastckpt_lightning.")


def _may_write(callback: Callback, hook: str) -> bool:
    implementation = _function(getattr(callback, hook, None))
    return implementation is not None and implementation not in _harmless(hook)


def _function(method: Any) -> Optional[Callable[..., Any]]:
    """The plain function behind a bound method (a hook set on the instance, as ``LambdaCallback`` does, too)."""
    return getattr(method, "__func__", method) if callable(method) else None


@functools.lru_cache(maxsize=None)
def _harmless(hook: str) -> frozenset[Callable[..., Any]]:
    """The implementations of ``hook`` that never write weights: ``Callback``'s no-op and the read-only stock ones."""
    found = {getattr(Callback, hook)}
    exempt = [*_READ_ONLY, *(name for name, hooks in _READ_ONLY_HOOKS.items() if hook in hooks)]
    for qualified in exempt:
        cls = _resolve(qualified)
        if cls is not None:
            found.add(_function(getattr(cls, hook, None)))
    found.discard(None)
    return frozenset(found)


def _resolve(qualified: str) -> Optional[type]:
    """The class named ``module.Name``, or None where this Lightning version has no such class."""
    import importlib

    module_name, _, name = qualified.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None
