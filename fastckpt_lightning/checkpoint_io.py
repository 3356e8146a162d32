"""``FastCheckpointIO``: Lightning's checkpoint plugin, built on the fastckpt core.

``Trainer(plugins=[FastCheckpointIO("fastckpt.yaml")])`` is all a user writes. Every path Lightning saves is one
genuine torch checkpoint file, the bytes ``torch.save`` would write (its zip CRC-32 fields filled in), so
``torch.load``, ``LightningModule.load_from_checkpoint`` and stock Lightning read it with or without fastckpt. Only
the speed differs: ``save_checkpoint`` pickles the small skeleton and returns; parameters and optimizer state are
copied lazily while the next batch runs, written by background workers, and the file appears under its name only
once it is complete and durable. Removals run behind pending saves.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Optional, Union

import lightning.pytorch as pl
from fastckpt import Checkpointer, CheckpointConfig, SaveHandle, open_storage
from fastckpt.tiers.catalog import Catalog
from fastckpt.errors import ConfigError, FastCkptError
from fastckpt.tiers.gc import collect_temp_files
from fastckpt.format.healthrecord import delete_with_record
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.trainer.states import TrainerStatus
from torch.optim import Optimizer

from fastckpt_lightning import pending
from fastckpt_lightning.bypass import warn_if_bypassed
from fastckpt_lightning.callback import FastCheckpointCallback
from fastckpt_lightning.config import build_config, for_directory, staging_mode
from fastckpt_lightning.healthy import last_healthy_or
from fastckpt_lightning.discovery import find_calling_trainer, scheduled_by_lightning, wrapped_by_async_io
from fastckpt_lightning.loggers import LoggerRelay, wrap_loggers
from fastckpt_lightning.pointer import split_path
from fastckpt_lightning.reader import read_checkpoint
from fastckpt_lightning import hooks
from fastckpt_lightning.loadhooks import LoadGuard
from fastckpt_lightning.stats import CheckpointStats, StatsBook, log_newest
from fastckpt_lightning.rootdefault import adopt_root
from fastckpt_lightning.steps import step_of
from fastckpt_lightning.versioning import see_pending_saves

log = logging.getLogger(__name__)

# The names Lightning's SLURM auto-requeue handler saves (`_CheckpointConnector.hpc_save_path`).
_REQUEUE_SAVE = re.compile(r"hpc_ckpt_\d+\.ckpt")


class FastCheckpointIO(CheckpointIO):
    """Fast, asynchronous checkpoints for the Lightning Trainer and Fabric.

    Args:
        config: a ``CheckpointConfig``, the path of a fastckpt YAML file, or a dict in the YAML schema.
        root: default checkpoint folder for :class:`FastModelCheckpoint` when it has no ``dirpath``.
        storage_options: fsspec options (credentials, ``client_kwargs: {endpoint_url: ...}``).
        staging: ``staging`` section overrides, e.g. ``{"mode": "eager"}``.
        persist: ``persist`` section overrides, e.g. ``{"workers": 4}``.
        retention: ignored with a warning (a YAML file's, quietly): ``ModelCheckpoint(save_top_k=...)`` decides.
        allowed_classes: extra ``module.QualName`` classes the safe loader may rebuild (core checkpoint folders).
        log_stats: put the newest checkpoint's ``fastckpt/*`` figures in the rows your loggers already write (off).
            Through ``LightningModule.log``, so only at ``log_every_n_steps``; ``stats`` keeps them either way.
        async_user_saves: ``trainer.save_checkpoint(path)`` called by your own code during ``fit`` (a callback)
            returns once the file is complete, as with stock Lightning, unless this is True; the saves
            ``ModelCheckpoint`` makes are asynchronous either way (docs/lightning.md, "When a file is there").
        async_user_hooks: your own code at an epoch or phase boundary (``on_train_epoch_start`` of your module or of
            a callback that is not one of Lightning's) sees the checkpoints saved before it as files, as with stock
            Lightning, unless this is True: then such a boundary only waits for the lazy copies, and the
            checkpoint saved just before it keeps its overlap with training (docs/lightning.md).
    """

    def __init__(
        self,
        config: Optional[Union[str, CheckpointConfig, dict[str, Any]]] = None,
        *,
        root: Optional[str] = None,
        storage_options: Optional[dict[str, Any]] = None,
        staging: Optional[dict[str, Any]] = None,
        persist: Optional[dict[str, Any]] = None,
        retention: Optional[dict[str, Any]] = None,
        allowed_classes: Optional[list[str]] = None,
        log_stats: bool = False,
        async_user_saves: bool = False,
        async_user_hooks: bool = False,
    ) -> None:
        self.config, self.root = build_config(
            config,
            root=root,
            storage_options=storage_options,
            staging=staging,
            persist=persist,
            retention=retention,
            allowed_classes=allowed_classes,
        )
        self.async_user_saves = bool(async_user_saves)
        self.async_user_hooks = bool(async_user_hooks)
        self.callback = FastCheckpointCallback(self)
        self._log_to_loggers = bool(log_stats)
        hooks.install(_companion_of)  # the callback's hooks run without it being in trainer.callbacks
        self._lazy = staging_mode(self.config) == "lazy"
        self._book = StatsBook()
        self._reset()

    def _reset(self) -> None:
        """The runtime state: none of it survives pickling (``ddp_spawn``, ``torch.save(trainer)``)."""
        self._folders: dict[str, Checkpointer] = {}
        self._watches: dict[str, list[Any]] = {}  # per folder: the core's WatchHandles
        self._removals: list[tuple[str, Future]] = []
        self._optimizers: list[tuple[Optimizer, bool]] = []
        self._trainer: Optional[weakref.ref] = None
        self._loads = LoadGuard(self._wait_before_load)  # load_state_dict pre-hooks on the trained module
        self._relay = LoggerRelay()  # loggers' after_save_checkpoint, deferred until the saves are durable
        self._warned_eager = False
        self._warned_root = False
        self._warned_bypass = False
        self._saves = 0

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k in ("config", "root", "callback", "_lazy", "_book",
                                                                 "_log_to_loggers", "async_user_saves",
                                                                 "async_user_hooks")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        hooks.install(_companion_of)  # a spawned process imports Lightning afresh
        self._reset()

    # ---- what users read -------------------------------------------------------------------------------------

    @property
    def stats(self) -> list[CheckpointStats]:
        """One record per committed checkpoint, oldest first."""
        return self._book.all()

    # ---- wiring ------------------------------------------------------------------------------------------------

    def attach(self, trainer: pl.Trainer) -> None:
        """Wire ``trainer`` and watch its optimizers. Done by the callback's first hook (``setup``), which runs before
        any other callback's (``fastckpt_lightning.hooks``) though it is not in ``trainer.callbacks``."""
        self._trainer = weakref.ref(trainer)
        see_pending_saves(trainer)
        wrap_loggers(trainer.loggers, self)
        self._warned_bypass = warn_if_bypassed(trainer.strategy, self._warned_bypass)  # stock sharded: not used
        self._adopt_root(trainer)
        module = trainer.lightning_module
        # Without a closure (manual optimization), torch's step pre-hook fires right before the update: use it too.
        hook = module is not None and not module.automatic_optimization
        self._set_optimizers([(optimizer, hook) for optimizer in trainer.optimizers])
        if module is not None:  # a load_state_dict (ModelCheckpoint's manual-optimization recipe) is a safe point
            self._loads.guard(module, trainer.optimizers)

    def _wait_before_load(self) -> None:
        self.wait_staged(raise_errors=False)

    def watch(self, optimizer: Optimizer) -> None:
        """Lazy copies under Fabric: the optimizer's ``step()`` will wait for pending copies first."""
        inner = getattr(optimizer, "optimizer", None)  # Fabric and Lightning wrap the torch optimizer
        optimizer = inner if isinstance(inner, Optimizer) else optimizer
        if all(known is not optimizer for known, _ in self._optimizers):
            self._set_optimizers([*self._optimizers, (optimizer, True)])

    @property
    def relay(self) -> LoggerRelay:
        """The loggers' deferred ``after_save_checkpoint`` calls (``fastckpt_lightning.loggers``)."""
        return self._relay

    def pending_handles(self) -> list[SaveHandle]:
        """The saves still in flight in this process."""
        return pending.handles()

    def deliver_logger_calls(self) -> None:
        """Run the loggers' deferred ``after_save_checkpoint`` calls whose saves landed (training thread)."""
        self._relay.deliver()

    # ---- CheckpointIO ----------------------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Snapshot ``checkpoint`` and return; ``path`` appears once the file is durable. Called on rank 0."""
        if storage_options is not None:
            raise TypeError(
                "FastCheckpointIO does not take per-call `storage_options`; pass them once, as"
                " FastCheckpointIO(storage_options=...) or in the fastckpt YAML."
            )
        if wrapped_by_async_io(self):
            raise ConfigError(
                "AsyncCheckpointIO(FastCheckpointIO()) saves nothing faster: AsyncCheckpointIO clones every tensor on"
                " the training thread first. FastCheckpointIO is already asynchronous: pass it to the Trainer directly,"
                " as Trainer(plugins=[FastCheckpointIO(...)])"
            )
        self._discover_trainer()
        path = os.fspath(path)
        folder, name = split_path(path)
        if "://" not in folder:
            # The file lands later, but Lightning may use the folder right away, as after a stock save:
            # save_last="link" symlinks last.ckpt next to the file being saved.
            os.makedirs(folder, exist_ok=True)
        checkpointer = self._folder(folder)
        if self._lazy and not self._optimizers:
            self._warn_eager()
        if self._relay.needs(path):  # a logger call queued before this save must see the previous file first
            self._relay.deliver(block=True)
        # A save the user's own code asked for (trainer.save_checkpoint from a callback or a script) is complete
        # when the call returns, as with stock: they may copy, upload or torch.load it next. Saves Lightning makes
        # on its own schedule (ModelCheckpoint) stay asynchronous; `async_user_saves=True` makes all of them so.
        complete = self._user_asked()
        handle = checkpointer.save_file(checkpoint, name, step=self._step_of(checkpoint))
        self._track(path, name, handle, complete=complete)

    def load_checkpoint(
        self, path: _PATH, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Read a checkpoint file (or an older fastckpt layout), as ``TorchCheckpointIO`` would. Called on every rank
        when resuming."""
        self.wait_staged(raise_errors=False)  # a load may overwrite parameters a lazy copy still reads
        path = last_healthy_or(path, self)  # fit(ckpt_path="last-healthy"): Lightning passes the word through
        return read_checkpoint(
            os.fspath(path),
            map_location=map_location,
            weights_only=weights_only,
            storage_options=self.config.storage_options,
            allowed_classes=self.config.allowed_classes,
            verify=self.config.persist.verify_on_load,
        )

    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete ``path`` after every save queued before it. Called on rank 0."""
        path = os.fspath(path)
        folder, name = split_path(path)
        checkpointer = self._folders.get(folder)
        if checkpointer is None and not self._overlapping():
            # Nothing of ours is pending in that folder and no loop runs (ddp_spawn's main process removing
            # `.temp.ckpt`): delete now rather than start threads that no teardown would stop.
            pending.wait_for(path)
            storage = open_storage(folder, self.config.storage_options)
            delete_with_record(storage, storage.join(storage.url, name))
            return
        # Behind the loggers' calls queued before it: stock logged the file before removing it.
        self._relay.hold(lambda: self._removals.append((path, self._folder(folder).remove_file(name))), path)

    def teardown(self) -> None:
        """Flush every pending save, stop the threads, raise a background error once. Called by the strategy."""
        try:
            self.flush()
        except BaseException:
            self._close(quiet=True)
            raise
        self._close(quiet=False)

    # ---- called by FastDDPStrategy on every rank (one file, shared writes) ----------------------------------

    def save_shared(self, checkpoint: dict[str, Any], path: str, trainer: pl.Trainer) -> None:
        """Every DDP rank, with its own ``checkpoint`` of the same training state: the ranks share the writes of the
        one file ``path`` (parameters and optimizer state split by bytes; everything else rank 0's), and rank 0
        commits it once every rank's part is durable. Collective: every rank calls it, in the same order."""
        self.attach(trainer)
        folder, name = split_path(path)
        if "://" not in folder:  # as in save_checkpoint: Lightning may use the folder right away
            os.makedirs(folder, exist_ok=True)
        checkpointer = self._folder(folder, distributed=True)
        if self._lazy and not self._optimizers:
            self._warn_eager()
        complete = self._user_asked()  # every rank decides alike: the same call stack shape
        handle = checkpointer.save_file(checkpoint, name, step=self._step_of(checkpoint))
        self._track(path, name, handle, complete=complete)

    # ---- called by FastModelParallelStrategy on every rank (sharded state) -------------------------------

    def save_sharded(self, checkpoint: dict[str, Any], path: str, trainer: pl.Trainer) -> None:
        """Snapshot this rank's DTensor blocks (lazily) into the checkpoint folder ``path``; rank 0 commits once."""
        self.attach(trainer)
        folder, name = split_path(path)
        handle = self._folder(folder, distributed=True).save(checkpoint, step=self._step_of(checkpoint), name=name)
        pending.add(path, handle)
        handle.durable.add_done_callback(lambda _: self._record(path, handle))
        if not self._overlapping():
            self.teardown()  # as in save_checkpoint: no teardown may follow a save outside a loop

    def load_sharded(self, path: str, target: dict[str, Any]) -> dict[str, Any]:
        """Load the checkpoint folder ``path`` into ``target``'s DTensors (resharding); the rest comes back fresh."""
        self.wait_staged(raise_errors=False)
        folder, name = split_path(path)
        return self._folder(folder, distributed=True).load_into(target, name=name)

    def remove_sharded(self, path: str) -> None:
        """Rank 0: delete the checkpoint folder ``path`` after every save queued before it."""
        folder, name = split_path(path)
        checkpointer = self._folders.get(folder)
        if checkpointer is None:
            # Never saved to in this process: building the folder's distributed Checkpointer is collective, and
            # Lightning removes on rank 0 alone. Nothing of ours is pending there; delete now, manifest first.
            Catalog(open_storage(folder, self.config.storage_options)).delete(name)
            return
        self._removals.append((path, checkpointer.delete(name)))

    # ---- called by the callback ----------------------------------------------------------------------------

    def wait_staged(self, raise_errors: bool = True) -> None:
        """Block until every lazy copy is done, so parameters may change."""
        for checkpointer in list(self._folders.values()):
            try:
                checkpointer.wait_staged()
            except FastCkptError:
                if raise_errors:
                    raise

    def flush(self) -> None:
        """Block until every checkpoint is durable and every removal done; raise the first background error once."""
        first: Optional[BaseException] = None
        for checkpointer in list(self._folders.values()):
            try:
                checkpointer.wait()
            except FastCkptError as e:
                first = first or e
        # Every save has ended: the loggers' deferred calls run now, before Lightning finalizes the loggers
        # (those of failed saves are dropped with a warning), and the removals held behind them are queued.
        self._relay.deliver(block=True)
        for checkpointer in list(self._folders.values()):
            try:
                checkpointer.wait()  # the removals the relay just released
            except FastCkptError as e:
                first = first or e
        removals, self._removals = self._removals, []
        for path, future in removals:
            error = future.exception()
            if error is not None and first is None:
                first = error
                log.error("fastckpt_lightning: removing %s failed: %s", path, error)
        if first is not None:
            raise first

    def log_stats(self, trainer: pl.Trainer, pl_module: Optional[pl.LightningModule]) -> None:
        """With ``log_stats=True``: hand the newest committed checkpoint's figures to ``pl_module.log`` (training
        thread, in a training batch hook), so the user's loggers write them in their own rows, at the user's
        ``log_every_n_steps``, never in rows or at steps of their own. Off: nothing reaches the loggers."""
        if not self._log_to_loggers or pl_module is None:
            return
        records = self._book.take_unlogged()
        if records:
            log_newest(pl_module, records)

    # ---- hooks for subclasses ------------------------------------------------------------------------------

    def _create_checkpointer(self, config: CheckpointConfig) -> Checkpointer:
        """Build the core Checkpointer of one folder. Tests override this to inject slow or faulty storage."""
        return Checkpointer(config)

    def _create_distributed_checkpointer(self, config: CheckpointConfig) -> Checkpointer:
        """Build the distributed core Checkpointer of one folder, sharded or of shared files (collective: every rank,
        same order). Tests override this to inject faulty storage."""
        return Checkpointer(config, distributed=True)

    # ---- internals -----------------------------------------------------------------------------------------

    def _track(self, path: str, name: str, handle: SaveHandle, complete: bool = False) -> None:
        """After a file's save is submitted: make it visible as pending, record its stats once durable, and finish
        it now where nothing follows that it could overlap with, or where the caller must find it complete."""
        pending.add(path, handle)
        handle.durable.add_done_callback(lambda _: self._record(path, handle))
        if (complete or _REQUEUE_SAVE.fullmatch(name)) and self._overlapping():
            # The user's own save (they may copy, upload or load it next), or Lightning's SLURM handler saving
            # `hpc_ckpt_N.ckpt` before SLURM requeues (kills) the job: the file must be complete when this returns, as
            # with stock Lightning (`hpc_save_path` numbers the next one from the files on disk). The rest of the run
            # keeps its threads.
            self.wait_staged()
            handle.wait()
        elif not self._overlapping():
            # Nothing runs next that a background save could overlap with (a save after fit, a script's direct
            # call): finish it here, so its errors surface here and the file exists when this returns; and stop
            # the threads, as no teardown may follow (stock Lightning leaves no thread behind either).
            self.teardown()

    def _user_asked(self) -> bool:
        """Whether this save must be complete when it returns: the user's own ``trainer.save_checkpoint`` during a
        fit (not ModelCheckpoint's), unless ``async_user_saves``. Fabric has no Trainer: ``watch(optimizer)`` is the
        opt-in to asynchronous saves there."""
        if self.async_user_saves or self._attached_trainer() is None:
            return False
        return not scheduled_by_lightning()

    def _record(self, path: str, handle: SaveHandle) -> None:
        if handle.durable.exception() is None:  # failures are raised, not recorded
            self._book.add(path, handle.stats)

    def _folder(self, url: str, distributed: bool = False) -> Checkpointer:
        checkpointer = self._folders.get(url)
        if checkpointer is not None and distributed and not checkpointer.distributed:
            # Rank 0 alone removed a file here before the first shared save (only rank 0 removes): its one-process
            # Checkpointer finishes that removal and gives way to the collective one the other ranks build now.
            del self._folders[url]
            for watch in self._watches.pop(url, []):
                watch.remove()
            checkpointer.close()
            checkpointer = None
        if checkpointer is None:
            config = for_directory(self.config, url)
            # Sharded strategies: every rank writes its own blocks (collective, on every rank's first use).
            make = self._create_distributed_checkpointer if distributed else self._create_checkpointer
            checkpointer = make(config)
            self._folders[url] = checkpointer
            self._watch(url)
            if _is_rank_zero():  # rank 0 alone: the ranks of a shared save see one folder
                collect_temp_files(checkpointer.storage, config.orphan_grace_s)
        return checkpointer

    def _watch(self, url: str) -> None:
        """Make exactly the current optimizers' tensors lazy-safe in one folder's core Checkpointer."""
        for watch in self._watches.pop(url, []):
            watch.remove()
        checkpointer = self._folders[url]
        self._watches[url] = [checkpointer.watch(optimizer, hook=hook) for optimizer, hook in self._optimizers]

    def _set_optimizers(self, optimizers: list[tuple[Optimizer, bool]]) -> None:
        unchanged = len(optimizers) == len(self._optimizers) and all(
            new is old and new_hook == old_hook
            for (new, new_hook), (old, old_hook) in zip(optimizers, self._optimizers)
        )
        if unchanged:
            return
        self._optimizers = optimizers
        for url in self._folders:
            self._watch(url)

    def _discover_trainer(self) -> None:
        # Looked up on every save (microseconds): the plugin may be reused by a new Trainer.
        trainer = find_calling_trainer(self)
        if trainer is not None:
            self.attach(trainer)

    def _attached_trainer(self) -> Optional[pl.Trainer]:
        return self._trainer() if self._trainer is not None else None

    def _overlapping(self) -> bool:
        """Whether training goes on after this save (a running Trainer loop, or a Fabric loop with watched
        optimizers), so the save may finish in the background."""
        trainer = self._attached_trainer()
        if trainer is not None:
            return trainer.state.status == TrainerStatus.RUNNING
        return bool(self._optimizers)

    def _adopt_root(self, trainer: pl.Trainer) -> None:
        self._warned_root = adopt_root(trainer, self.root, self._warned_root)

    def _step_of(self, checkpoint: Mapping[str, Any]) -> int:
        self._saves += 1
        step = step_of(checkpoint)
        # A state with no step and no optimizer counter: number the saves instead (the step is informational).
        return self._saves if step is None else step

    def _warn_eager(self) -> None:
        if not self._warned_eager:
            self._warned_eager = True
            warnings.warn(
                "FastCheckpointIO found no optimizer to watch (no Lightning Trainer is calling it), so checkpoints"
                " are copied eagerly inside save_checkpoint. Under Fabric, call `plugin.watch(optimizer)` to copy"
                " parameters lazily.",
                UserWarning,
                stacklevel=3,
            )

    def _close(self, quiet: bool) -> None:
        folders, self._folders = self._folders, {}
        self._watches = {}
        self._loads.remove()
        self._trainer = None
        self._optimizers = []
        self._relay.clear()
        for checkpointer in folders.values():
            try:
                checkpointer.close()
            except FastCkptError:
                if not quiet:
                    raise
                log.exception("fastckpt_lightning: error while closing after an earlier error")


def _companion_of(checkpoint_io: Any) -> Optional[FastCheckpointCallback]:
    """The callback ``hooks`` runs first for a Trainer whose strategy holds ``checkpoint_io``."""
    return checkpoint_io.callback if isinstance(checkpoint_io, FastCheckpointIO) else None


def _is_rank_zero() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
