"""Loggers see each checkpoint once it is complete: their ``after_save_checkpoint`` waits for pending saves.

``MLFlowLogger``/``WandbLogger(log_model="all")`` scan the checkpoint folder in ``after_save_checkpoint``, which
``ModelCheckpoint`` calls right after each save, and skip files that do not exist yet. With asynchronous saves the
new file is not there yet (never logged), and a file saved again under its name (``last.ckpt``) is logged stale.

The plugin wraps each logger whose class overrides ``after_save_checkpoint`` with a method of its own, a ``Logger``
subclass or a duck-typed logger alike. Loggers it cannot wrap (``Mock``/``MagicMock`` loggers, duck-typed ones
without the method) are left as stock leaves them. A call made while saves are pending
in this process is queued with a copy of the ``ModelCheckpoint``'s attributes at that moment and the saves pending
then. Queued calls run on the training thread, in order, once those saves are durable: at batch starts, epoch and
validation ends, at the next call, and in the plugin's flush, which runs before the loggers' ``finalize``. For the
duration of a queued call the ``ModelCheckpoint``'s attributes are those of the moment of the call (the scan sees
what it would have seen after a stock save), then restored. Checkpoint removals queued after a call wait behind it
(stock logged a file before removing it; so does this). A call whose saves failed is dropped with a warning: it
would log a stale file.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from fastckpt import SaveHandle
from lightning.pytorch.loggers.logger import Logger

log = logging.getLogger("fastckpt")


@dataclass
class _Call:
    """One deferred ``logger.after_save_checkpoint(callback)``."""

    logger: Any
    callback: Any  # what ModelCheckpoint passed: a weakref.proxy to itself
    state: dict[str, Any]  # the callback's attributes at the call
    handles: list[SaveHandle] = field(default_factory=list)


@dataclass
class _Held:
    """An action (a checkpoint removal) that must run after every call queued before it."""

    action: Callable[[], None]
    path: str


class LoggerRelay:
    """The queue of deferred logger calls and held removals of one plugin (training thread only)."""

    def __init__(self) -> None:
        self._queue: deque[Union[_Call, _Held]] = deque()

    def call(self, logger: Any, callback: Any, handles: list[SaveHandle]) -> None:
        """``logger.after_save_checkpoint(callback)``, now if nothing is pending, else once ``handles`` are durable."""
        self.deliver()
        waiting = [h for h in handles if not h.done()]
        if not self._queue and not waiting:
            _original(logger, callback)
            return
        self._queue.append(_Call(logger, callback, _freeze(callback), waiting))

    def hold(self, action: Callable[[], None], path: str) -> None:
        """Run ``action`` now if no call is queued, else right after the calls queued before it."""
        if not self._queue:
            action()
        else:
            self._queue.append(_Held(action, path))

    def needs(self, path: str) -> bool:
        """Whether a queued item is about ``path``: a held removal of it (a new save of ``path`` must not be removed
        by it), or a call whose scan would see the file (saved again, it would be logged with the new bytes and the
        old score, and the later call would skip it as already logged). A new save of ``path`` waits for them."""
        for item in self._queue:
            if isinstance(item, _Held):
                if item.path == path:
                    return True
            elif path in _scanned(item.state):
                return True
        return False

    def deliver(self, block: bool = False) -> None:
        """Run the queued calls whose saves are durable, in order (``block``: wait for the saves, run them all)."""
        while self._queue:
            item = self._queue[0]
            if isinstance(item, _Call) and not all(h.done() for h in item.handles):
                if not block:
                    return
                for h in item.handles:
                    h.wait_staged()  # seals a lazy save on this (the training) thread: it commits only once sealed
                    h.blocking()
                concurrent.futures.wait([h.durable for h in item.handles])
            self._queue.popleft()
            if isinstance(item, _Held):
                item.action()
            else:
                _replay(item)

    def clear(self) -> None:
        """Forget queued calls (after teardown delivered what could be). Held removals still run."""
        while self._queue:
            item = self._queue.popleft()
            if isinstance(item, _Held):
                item.action()


class DeferredAfterSave:
    """Replaces one logger's ``after_save_checkpoint`` (an instance attribute; module level: loggers are pickled
    with the Trainer under ``ddp_spawn``). ``owner`` is the plugin: ``owner.relay``, ``owner.pending_handles()``."""

    def __init__(self, owner: Any, logger: Any) -> None:
        self.owner = owner
        self.logger = logger

    def __call__(self, checkpoint_callback: Any) -> None:
        relay: Optional[LoggerRelay] = getattr(self.owner, "relay", None)
        if relay is None:  # the plugin is closed (a save after fit finished in the call): stock behaviour
            _original(self.logger, checkpoint_callback)
            return
        relay.call(self.logger, checkpoint_callback, self.owner.pending_handles())


def wrap_loggers(loggers: list[Any], owner: Any) -> None:
    """Called by ``FastCheckpointIO.attach``: defer ``after_save_checkpoint`` of each logger that has one."""
    for logger in loggers:
        own = _own_attributes(logger)
        current = own.get("after_save_checkpoint") if own is not None else None
        if isinstance(current, DeferredAfterSave):
            if current.owner is not owner:  # wrapped by an earlier plugin: this one takes the calls over
                logger.after_save_checkpoint = DeferredAfterSave(owner, logger)
            continue
        if own is None or current is not None or not _wrappable(type(logger)):
            # Left as stock leaves it: a Mock/MagicMock logger (its attributes are made on access, and tests assert
            # on them), a duck-typed logger without the method (stock fails only at a save, and so does this), one
            # that sets it on the instance itself or has no instance dict, or one doing nothing there (TensorBoard).
            continue
        logger.after_save_checkpoint = DeferredAfterSave(owner, logger)


def _own_attributes(logger: Any) -> Optional[dict[str, Any]]:
    """``logger``'s instance ``__dict__``; None for a class with ``__slots__`` only (nothing can be set on it)."""
    try:
        return vars(logger)
    except TypeError:
        return None


def _wrappable(cls: type) -> bool:
    """Whether the class defines ``after_save_checkpoint`` as a plain method that does something. Read statically:
    a class without it (a duck-typed logger, ``Mock``) or with a stand-in (``mock.patch.object``) is recognised
    without calling or creating anything."""
    try:
        method = inspect.getattr_static(cls, "after_save_checkpoint")
    except AttributeError:
        return False
    return inspect.isfunction(method) and method is not Logger.after_save_checkpoint


def _original(logger: Any, callback: Any) -> None:
    type(logger).after_save_checkpoint(logger, callback)


def _freeze(callback: Any) -> dict[str, Any]:
    """The callback's attributes now, containers copied one level (``best_k_models`` changes at the next save)."""
    state = dict(callback.__dict__)
    return {k: (type(v)(v) if isinstance(v, (dict, list, set)) else v) for k, v in state.items()}


def _scanned(state: dict[str, Any]) -> set[str]:
    """The paths a logger's scan of a ModelCheckpoint in ``state`` looks at (lightning's ``_scan_checkpoints``)."""
    paths = {state.get("last_model_path"), state.get("best_model_path"), *(state.get("best_k_models") or {})}
    return {str(p) for p in paths if p}


def _replay(call: _Call) -> None:
    failed = [h for h in call.handles if h.durable.exception() is not None]
    if failed:
        log.warning("fastckpt: %s.after_save_checkpoint skipped: the save of %s failed, and logging now would log a "
                    "stale or missing file (the error is raised by the plugin)", type(call.logger).__name__,
                    ", ".join(h.path for h in failed))
        return
    try:
        live = call.callback.__dict__
    except ReferenceError:  # the ModelCheckpoint is gone: nothing to scan
        return
    now = dict(live)
    live.update(call.state)  # as at the call: the scan sees what it saw after a stock save
    try:
        _original(call.logger, call.callback)
    finally:
        live.clear()
        live.update(now)
