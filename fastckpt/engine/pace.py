"""Whether persistence keeps pace with ``save()``, measured, and the warnings a user reads once per process.

A save that finds an earlier one pending is normal (``save_last`` right after another save; a checkpoint interval
shorter than one write): the persisting threads are raised quietly. Persistence falls behind only when a save must
wait for a staging slot (training stalls) or a checkpoint stays not durable past ``persist.max_lag_s``; then one
warning per process, on rank 0, names the measured lag (``once.WARNED``).
"""
from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING

import torch

from ..errors import RetakenSnapshotWarning
from .once import WARNED

if TYPE_CHECKING:
    from .handle import SaveHandle
    from .priority import ThreadPriorities

__all__ = ["keep_pace", "slot_wait_reason", "warn_all_eager", "warn_retake"]

log = logging.getLogger("fastckpt")


def keep_pace(pending: list[SaveHandle], priorities: ThreadPriorities, max_lag_s: float, name: str) -> None:
    """Called by ``save()`` before it takes a slot: raise the persisting threads while an earlier save is pending
    (warning only when the oldest has lagged past ``max_lag_s``), lower them once nothing is."""
    if not pending:
        priorities.settle()  # caught up: training comes first again
        return
    oldest = pending[0]
    lag = time.monotonic() - oldest.submitted
    if lag > max_lag_s:
        priorities.raise_(f"checkpoint {oldest.name!r} was still not durable {lag:.1f} s after its save() when "
                          f"{name!r} was saved; persist.max_lag_s is {max_lag_s:g} s", behind=True)
    else:
        priorities.raise_(f"{oldest.name!r} pending", behind=False)


def slot_wait_reason(pending: list[SaveHandle], slots: int, name: str) -> str:
    """Why save ``name`` is about to wait for a staging slot, with the measured lag of the oldest pending save."""
    lag = "" if not pending else (f"; the oldest pending checkpoint, {pending[0].name!r}, was saved "
                                  f"{time.monotonic() - pending[0].submitted:.1f} s ago and is not durable yet")
    return (f"save {name!r} waits for a staging slot: all {slots} are busy{lag}; training stalls until one frees "
            "(staging.slots, or staging.when_busy: skip)")


def warn_all_eager(name: str, tensors: list[torch.Tensor]) -> None:
    """Once per process: a lazy-mode ``save()`` with nothing lazy copies the whole state inside ``save()``."""
    if not WARNED.first("all-eager"):
        return
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    log.warning("fastckpt: save(%r) copies all %d tensors (%.1f MB) inside save(), because none of them is lazy (no "
                "watched optimizer owns them, and save(lazy=...) names none), so the training thread waits for the whole copy (seconds for GBs), not "
                "milliseconds. Call checkpointer.watch(optimizer) once (its parameters and state are then copied "
                "while training goes on, until its next step()), or pass save(..., lazy=[tensors or key patterns]) "
                "for tensors that do not change before you say so; set staging.mode: eager to copy everything "
                "inside save() without this warning. Warned once.", name, len(tensors), nbytes / 1e6)


def warn_retake(name: str, keys: list[str]) -> None:
    """Once per process: a lazy snapshot was refused at its seal and taken again (staging.on_mutation: retake).
    A ``RetakenSnapshotWarning``, so that warning filters, ``pytest.warns`` and ``logging.captureWarnings`` see it;
    called once the retake ran, so a filter that turns it into an error raises with the checkpoint taken."""
    if not WARNED.first("retake"):
        return
    shown = ", ".join(repr(k) for k in keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
    warnings.warn(f"fastckpt: checkpoint {name!r}: {shown} changed after save() returned and before the next "
                  "optimizer step (outside step(): an EMA swap, weight clipping, a write through .data), so the lazy "
                  "snapshot was refused and taken again, whole, at that point (its values are those of that "
                  "moment); these tensors are copied inside save() from now on. To keep the values of save() itself, "
                  "call Checkpointer.wait_staged() before such writes or set staging.mode: eager; set "
                  "staging.on_mutation: raise to refuse such a checkpoint instead. Warned once.",
                  RetakenSnapshotWarning, stacklevel=2)
