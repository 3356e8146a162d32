"""Dispatching the companion callback's hooks without putting it in ``trainer.callbacks``.

The user's callback list is the user's: Lightning's tuner and restore code check ``trainer.callbacks[0]``, and a
callback inserted while Lightning iterates the live list (batch hooks iterate it, not a copy) makes the callback that
triggered a save run twice. So the plugin's callback is not in the list at all. Lightning dispatches every callback
hook through one function, ``lightning.pytorch.trainer.call._call_callback_hooks`` (looked up on the module at each
call, also by ``call`` itself); ``install`` wraps it once per process so that, for a Trainer whose strategy holds a
``FastCheckpointIO``, the plugin's callback runs first, before any other callback, from the very first hook
(``setup``) on. Other Trainers see no difference. A user who passed ``plugin.callback`` explicitly keeps it where they
put it, and it runs once.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer import call

from fastckpt.errors import FastCkptError, MissingCredentialsError

_LOCK = threading.Lock()
_MARK = "__fastckpt_dispatch__"


def install(companion_of: Callable[[Any], Optional[Callback]]) -> None:
    """Wrap Lightning's callback dispatch once per process. ``companion_of(checkpoint_io)`` returns the callback of
    a ``FastCheckpointIO`` (None for any other plugin)."""
    with _LOCK:
        original = call._call_callback_hooks
        if getattr(original, _MARK, False):
            return

        @functools.wraps(original)
        def dispatch(trainer: pl.Trainer, hook_name: str, *args: Any, monitoring_callbacks: Optional[bool] = None,
                     **kwargs: Any) -> None:
            callback = _companion(trainer, companion_of)
            # monitoring_callbacks=True runs only ModelCheckpoint/EarlyStopping: ours is neither.
            if callback is not None and monitoring_callbacks is not True:
                _run(trainer, callback, hook_name, args, kwargs)
            try:
                original(trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kwargs)
            except Exception as e:
                if callback is None or isinstance(e, FastCkptError) or not MissingCredentialsError.caused(e):
                    raise
                raise _credentials_error(hook_name, e) from e

        setattr(dispatch, _MARK, True)
        call._call_callback_hooks = dispatch


def _credentials_error(hook_name: str, e: BaseException) -> MissingCredentialsError:
    """A stock callback's bare "Unable to locate credentials": ``ModelCheckpoint`` opens its ``dirpath`` with
    fsspec's default options (the environment), never the plugin's ``storage_options`` (docs/lightning.md)."""
    return MissingCredentialsError(
        f"a callback's {hook_name} hook could not reach its folder ({type(e).__name__}): ModelCheckpoint opens its "
        "dirpath with fsspec's default options, not FastCheckpointIO's storage_options; "
        + MissingCredentialsError.fix('fsspec.config.conf["s3"] (and the endpoint in its client_kwargs, or '
                                      "AWS_ENDPOINT_URL)"))


def _companion(trainer: pl.Trainer, companion_of: Callable[[Any], Optional[Callback]]) -> Optional[Callback]:
    """The callback to run first for ``trainer``, or None (another plugin, or the user listed it themselves)."""
    # The private slot: the public property swaps in a default plugin inside wrapping plugins.
    callback = companion_of(getattr(getattr(trainer, "strategy", None), "_checkpoint_io", None))
    if callback is None or any(listed is callback for listed in trainer.callbacks):
        return None
    return callback


def _run(trainer: pl.Trainer, callback: Callback, hook_name: str, args: tuple, kwargs: dict) -> None:
    """Call one hook as Lightning calls a listed callback's: under the hook's name (``self.log`` needs it)."""
    fn = getattr(callback, hook_name, None)
    if not callable(fn):
        return
    pl_module = trainer.lightning_module
    previous = pl_module._current_fx_name if pl_module is not None else None
    if pl_module is not None:
        pl_module._current_fx_name = hook_name
    try:
        with trainer.profiler.profile(f"[Callback]{callback.state_key}.{hook_name}"):
            fn(trainer, pl_module, *args, **kwargs)
    finally:
        if pl_module is not None:
            pl_module._current_fx_name = previous
