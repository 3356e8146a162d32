"""``FastCheckpointIO``: Lightning's checkpoint plugin, built on the fastckpt core.

``Trainer(plugins=[FastCheckpointIO("fastckpt.yaml")])`` is all a user writes. On the first save the plugin finds the
calling Trainer, installs :class:`FastCheckpointCallback` and tells the core which optimizer tensors may be copied
lazily. Every ``save_checkpoint`` returns after the eager copies; the data is committed in the background and the
path Lightning sees appears (as a small pointer file) only then. Removals run behind pending saves.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import weakref
from collections.abc import Mapping
from functools import partial
from typing import Any, Optional, Union

import lightning.pytorch as pl
from fastckpt import Checkpointer, CheckpointConfig, SaveHandle
from fastckpt.errors import FastCkptError
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from torch.optim import Optimizer

from fastckpt_lightning.callback import FastCheckpointCallback
from fastckpt_lightning.config import build_config, staging_mode
from fastckpt_lightning.dedup import SaveRecord, fingerprint, shares_with, split_checkpoint
from fastckpt_lightning.discovery import find_calling_trainer
from fastckpt_lightning.folder import CheckpointFolder
from fastckpt_lightning.pointer import Pointer, split_path
from fastckpt_lightning.publisher import Publisher
from fastckpt_lightning.reader import read_checkpoint
from fastckpt_lightning.stats import CheckpointStats, StatsBook, log_to

log = logging.getLogger(__name__)


class FastCheckpointIO(CheckpointIO):
    """Fast, asynchronous checkpoints for the Lightning Trainer and Fabric.

    Args:
        config: a ``CheckpointConfig``, the path of a fastckpt YAML file, or a dict in the YAML schema.
        root: default checkpoint folder for :class:`FastModelCheckpoint` when it has no ``dirpath``.
        storage_options: fsspec options (credentials, ``client_kwargs: {endpoint_url: ...}``).
        staging: ``staging`` section overrides, e.g. ``{"mode": "eager"}``.
        persist: ``persist`` section overrides, e.g. ``{"workers": 4}``.
        retention: ignored with a warning: ``ModelCheckpoint(save_top_k=...)`` decides what is kept.
        allowed_classes: extra ``module.QualName`` classes the safe loader may rebuild.
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
        self.callback = FastCheckpointCallback(self)
        self._lazy = staging_mode(self.config) == "lazy"
        self._folders: dict[str, CheckpointFolder] = {}
        self._publisher = Publisher()
        self._book = StatsBook()
        self._record: Optional[SaveRecord] = None
        self._optimizers: list[tuple[Optimizer, bool]] = []
        self._trainer: Optional[weakref.ref] = None
        self._warned_eager = False
        self._saves = 0

    # ---- what users read -------------------------------------------------------------------------------------

    @property
    def stats(self) -> list[CheckpointStats]:
        """One record per committed checkpoint, oldest first."""
        return self._book.all()

    # ---- wiring ------------------------------------------------------------------------------------------------

    def attach(self, trainer: pl.Trainer) -> None:
        """Install the callback in ``trainer`` and watch its optimizers. Done automatically on the first save."""
        self._trainer = weakref.ref(trainer)
        if not any(callback is self.callback for callback in trainer.callbacks):
            # First, so its waits run before any other callback can change parameters (SWA, EMA...).
            trainer.callbacks.insert(0, self.callback)
        module = trainer.lightning_module
        # Without a closure (manual optimization), torch's step pre-hook fires right before the update: use it too.
        hook = module is not None and not module.automatic_optimization
        self._set_optimizers([(optimizer, hook) for optimizer in trainer.optimizers])

    def watch(self, optimizer: Optimizer) -> None:
        """Lazy copies under Fabric: the optimizer's ``step()`` will wait for pending copies first."""
        inner = getattr(optimizer, "optimizer", None)  # Fabric and Lightning wrap the torch optimizer
        optimizer = inner if isinstance(inner, Optimizer) else optimizer
        if all(known is not optimizer for known, _ in self._optimizers):
            self._set_optimizers([*self._optimizers, (optimizer, True)])

    # ---- CheckpointIO ----------------------------------------------------------------------------------------

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Snapshot ``checkpoint`` and return; ``path`` appears once the data is committed. Called on rank 0."""
        started = time.perf_counter()
        if storage_options is not None:
            raise TypeError(
                "FastCheckpointIO does not take per-call `storage_options`; pass them once, as"
                " FastCheckpointIO(storage_options=...) or in the fastckpt YAML."
            )
        self._publisher.raise_error()
        self._discover_trainer()
        path = os.fspath(path)
        folder_url, basename = split_path(path)
        folder = self._folder(folder_url)
        step = self._step_of(checkpoint)
        weights, state = split_checkpoint(checkpoint)
        shared, written = self._save_weights(folder, path, basename, step, checkpoint, weights)
        written.append(folder.save(state, step, basename, "state"))
        handles = shared + written  # everything the pointer depends on
        pointer = Pointer(parts=tuple(handle.name for handle in handles), step=step)
        blocking_ms = (time.perf_counter() - started) * 1e3
        folder.reserve(pointer.parts)
        job = partial(self._publish, folder, path, basename, pointer, handles, written, blocking_ms)
        self._publisher.submit(job, what=f"saving checkpoint {path!r}")

    def _save_weights(
        self,
        folder: CheckpointFolder,
        path: str,
        basename: str,
        step: int,
        checkpoint: Mapping[str, Any],
        weights: dict[str, Any],
    ) -> tuple[list[SaveHandle], list[SaveHandle]]:
        """Save the weights part, or reuse the previous save's; returns (shared handles, new handles)."""
        if not weights:
            self._warn_if_eager()
            return [], []
        batches = self._batches_seen()
        current = fingerprint(checkpoint) if batches is not None else ()
        record = self._record
        if record is not None and shares_with(record, folder.folder, step, batches, current):
            return [record.handle], []
        self._warn_if_eager()
        handle = folder.save(weights, step, basename, "weights")
        # Sharing needs the callback's batch counter: without it, two saves at one step may differ in buffers.
        self._record = SaveRecord(folder.folder, path, step, batches, current, handle.name, handle) if (
            batches is not None
        ) else None
        return [], [handle]

    def load_checkpoint(
        self, path: _PATH, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Read a checkpoint (pointer, core folder or torch file). Called on every rank when resuming."""
        # Fabric may load right after saving: let this process's pending pointers appear first.
        self._publisher.drain()
        self.wait_staged()  # the caller writes what it loads into parameters that lazy copies may still read
        # `weights_only` needs no handling: the core rebuilds objects only through torch's weights_only unpickler.
        return read_checkpoint(
            os.fspath(path),
            map_location=map_location,
            storage_options=self.config.storage_options,
            allowed_classes=self.config.allowed_classes,
        )

    def remove_checkpoint(self, path: _PATH) -> None:
        """Delete ``path`` and any data only it names, after every save queued before. Called on rank 0."""
        path = os.fspath(path)
        if self._record is not None and self._record.path == path:
            self._record = None  # its data may be gone before the next save could share it
        folder_url, basename = split_path(path)
        folder = self._folder(folder_url)
        self._publisher.submit(partial(folder.unpublish, basename), what=f"removing checkpoint {path!r}")

    def teardown(self) -> None:
        """Flush every pending save, stop the threads, raise a background error once. Called by the strategy."""
        try:
            self.flush()
        except BaseException:
            self._close(quiet=True)
            raise
        self._close(quiet=False)

    # ---- called by the callback ----------------------------------------------------------------------------

    def wait_staged(self, raise_errors: bool = True) -> None:
        """Block until every lazy copy is done, so parameters may change."""
        for folder in list(self._folders.values()):
            try:
                folder.checkpointer.wait_staged()
            except FastCkptError:
                if raise_errors:
                    raise

    def flush(self) -> None:
        """Block until every checkpoint is committed and published; raise the first background error once."""
        self._publisher.drain()
        core_error: Optional[FastCkptError] = None
        for folder in list(self._folders.values()):
            try:
                folder.checkpointer.wait()
            except FastCkptError as e:
                core_error = core_error or e
        # The publisher saw the same failure through its handle (with the path Lightning used): prefer its report.
        self._publisher.raise_error()
        if core_error is not None:
            raise core_error

    def log_stats(self, trainer: pl.Trainer) -> None:
        """Send the stats of newly committed checkpoints to the trainer's loggers (training thread only)."""
        records = self._book.take_unlogged()
        if records and trainer.is_global_zero:
            log_to(trainer.loggers, records)

    # ---- hooks for subclasses ------------------------------------------------------------------------------

    def _create_checkpointer(self, config: CheckpointConfig) -> Checkpointer:
        """Build the core Checkpointer of one folder. Tests override this to inject slow or faulty storage."""
        return Checkpointer(config)

    # ---- internals -----------------------------------------------------------------------------------------

    def _publish(
        self,
        folder: CheckpointFolder,
        path: str,
        basename: str,
        pointer: Pointer,
        handles: list[SaveHandle],
        written: list[SaveHandle],
        blocking_ms: float,
    ) -> None:
        folder.publish(basename, pointer, handles)
        stats = [handle.stats for handle in written]
        shared = len(written) < len(handles)
        self._book.add(CheckpointStats.combine(path, pointer.step, blocking_ms, stats, deduplicated=shared))

    def _folder(self, url: str) -> CheckpointFolder:
        folder = self._folders.get(url)
        if folder is None:
            folder = CheckpointFolder(url, self.config, self._create_checkpointer)
            folder.watch(self._optimizers)
            self._folders[url] = folder
        return folder

    def _set_optimizers(self, optimizers: list[tuple[Optimizer, bool]]) -> None:
        unchanged = len(optimizers) == len(self._optimizers) and all(
            new is old and new_hook == old_hook
            for (new, new_hook), (old, old_hook) in zip(optimizers, self._optimizers)
        )
        if unchanged:
            return
        self._optimizers = optimizers
        for folder in self._folders.values():
            folder.watch(optimizers)

    def _discover_trainer(self) -> None:
        # Looked up on every save (microseconds): the plugin may be reused by a new Trainer.
        trainer = find_calling_trainer(self)
        if trainer is not None:
            self.attach(trainer)

    def _attached_trainer(self) -> Optional[pl.Trainer]:
        return self._trainer() if self._trainer is not None else None

    def _batches_seen(self) -> Optional[int]:
        trainer = self._attached_trainer()
        if trainer is None or not any(callback is self.callback for callback in trainer.callbacks):
            return None
        return self.callback.batches_seen

    def _step_of(self, checkpoint: Mapping[str, Any]) -> int:
        self._saves += 1
        step = checkpoint.get("global_step")
        # Fabric states carry no global_step: number the saves instead (the step is informational).
        return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else self._saves

    def _warn_if_eager(self) -> None:
        if self._lazy and not self._optimizers and not self._warned_eager:
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
        self._record = None
        self._trainer = None
        self._optimizers = []
        try:
            for folder in folders.values():
                try:
                    folder.close()
                except FastCkptError:
                    if not quiet:
                        raise
                    log.exception("fastckpt_lightning: error while closing after an earlier error")
        finally:
            self._publisher.close()
