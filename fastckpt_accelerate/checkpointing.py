"""``FastAccelerateCheckpointing``: what ``accelerator.save_state``/``load_state`` do once fastckpt is enabled.

Save (every process calls ``save_state``, as Accelerate requires): 1. pick the target (``checkpoint_{iteration}``
under the root, or ``output_dir``); the main process refuses a reused automatic name and creates the folder, as
Accelerate does; 2. gather every process's RNG states (one small collective); 3. the main process hands the files
stock ``save_state`` writes (``native.stock_files``) to ``Checkpointer.save_files``, which returns in milliseconds
(with ``complete_folders``, a new local folder is written under a hidden sibling name and renamed at its commit):
tensors are copied in the background (the watched optimizers' ``step()`` waits until they are), each torch file's
pickle is unpickled as ``load_state`` will (``foreign.save_loaders``: a refusal fails the save, naming the keys),
each file is written in its stock format, ``manifest.json`` last; retention (``total_limit``) then removes the
oldest folders. On S3 with several processes every process first uploads its parts of the model and optimizer
files (``sharedobjects.py``), which the main process's bundle waits for; 4. ``iteration`` advances, as in Accelerate.

Load: the main process picks the folder (after pending saves of it, from any Accelerator in the process, commit)
and reads its manifest; then every process runs Accelerate's own ``load_state`` on it
(``foreign.load_accelerate_folder``: nothing unpickled without restriction), its reads routed through
``fastload.FolderReader``: the model's safetensors straight into its tensors, the torch files read whole and
unpickled over those bytes, each file checked against the manifest as it is read, an error on one process raised
on all. Folders in the core layout of fastckpt <= 0.2 load through ``state.py``; folders written by stock
Accelerate load through the same reader (their torch files checked against their zip CRC-32).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import time
import weakref
from dataclasses import replace
from typing import Any, Callable

from accelerate import Accelerator

from fastckpt import CheckpointConfig, Checkpointer, RemoteOptions, load_checkpoint
from fastckpt.errors import (CheckpointNotFoundError, ConfigError, FastCkptError, IntegrityError,
                             UnsafeCheckpointError)
from fastckpt.engine.exithook import register_exit_hook
from fastckpt.format.bundle import TORCH

from . import naming
from .distributed import all_gather, broadcast_from_main, can_share_writes
from .fastload import FolderReader
from .healthy import newest, newest_or_none
from .loadstats import LoadStateStats
from .folder import CORE, FILES, inspect_folder, local_folder, unlisted_files
from .foreign import load_accelerate_folder, save_loaders
from .native import rng_file_state, stock_files
from .outcome import Outcome, remote_error
from .sharedobjects import shared_objects
from .staging import check_complete_folders, stage
from .state import META_KEY, read_meta, restore_process_state, restore_state
from .stats import StatsLogger
from .watcher import OptimizerWatcher, close_all

logger = logging.getLogger(__name__)
_LIVE: "weakref.WeakSet[FastAccelerateCheckpointing]" = weakref.WeakSet()  # a load waits for their saves
NATIVE_FORMAT = 2  # the meta block's format: 1 was the core layout (state.py)


class FastAccelerateCheckpointing:
    """Owns the Checkpointers (main process only) behind one Accelerator's ``save_state``/``load_state``."""

    def __init__(
        self,
        accelerator: Accelerator,
        config: CheckpointConfig,
        *,
        storage: Any = None,
        log_stats: bool = False,
        shared_writes: bool | None = None,
        original_load_state: Callable[..., Any] | None = None,
        allow_unsafe_pickle: bool = False,
        original_wait_for_everyone: Callable[[], Any] | None = None,
        complete_folders: bool = False,
    ) -> None:
        self._closed = True  # until construction succeeds, so close() is safe on a half-built object
        if config.staging.shm:  # resolve_config drops it from a YAML; a config built by hand gets this error
            raise ConfigError("staging.shm does not apply to Accelerate's native folders; set staging.shm: false")
        self._accelerator = accelerator
        self.config = config
        self.root = naming.normalize(config.root)
        self._storage = storage
        self._original_load_state = original_load_state
        self._original_wait_for_everyone = original_wait_for_everyone
        self.allow_unsafe_pickle = bool(allow_unsafe_pickle)  # see foreign.py: Accelerate folders' pickles
        self._checkpointers: dict[str, Checkpointer] = {}
        self._watchers: dict[str, OptimizerWatcher] = {}
        self._stats_logger = StatsLogger(accelerator) if log_stats else None
        self._in_flight: list[Any] = []  # SaveHandles not known to be finished (pruned at each save)
        self._last_handle: Any | None = None
        self.save_state_ms: list[float] = []
        self.last_load_stats: LoadStateStats | None = None  # what the last load_state read, and how
        self.complete_folders = bool(complete_folders)  # a new folder appears under its name only once committed
        if self.complete_folders:
            check_complete_folders(self.root, shared_writes)
        possible = can_share_writes(accelerator, self.root) and not self.complete_folders
        if shared_writes and not possible:
            raise ConfigError(
                f"shared_writes=True, but the processes cannot share the writes under {self.root}: that needs "
                "several processes (torch.distributed initialized), and a root every process can write for rank 0 "
                "to commit (an s3:// URL, or a local path with every process on one node); pass shared_writes=None"
            )
        self.shared_writes = possible if shared_writes is None else bool(shared_writes)
        self._shared, self.config = shared_objects(self.root, self.shared_writes, config, storage, self._checkpointers,
                                                   self._watchers)  # S3: each process uploads parts of the big files
        self._closed = False
        _LIVE.add(self)
        # A script that ends without end_training() must still commit its last checkpoints. A weak
        # reference, so that the exit hook does not keep a dropped Accelerator alive.
        register_exit_hook(functools.partial(_close_at_exit, weakref.ref(self)))  # never runs in a fork()ed child

    # ----------------------------------------------------------------- public surface

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The Checkpointer of the configured root; None on processes other than the main one unless
        ``shared_writes``."""
        return self._checkpointers.get(self.root)

    @property
    def closed(self) -> bool:
        """Whether ``close()`` (or ``accelerator.end_training()``) ran."""
        return self._closed

    @property
    def stats(self) -> list[Any]:
        """``SaveStats`` of every finished save (each process's own part with ``shared_writes``; else the main
        process's, and empty elsewhere)."""
        return [s for ckpt in self._checkpointers.values() for s in ckpt.stats]

    @property
    def last_handle(self) -> Any | None:
        """The ``SaveHandle`` of the latest save on this process, if it saved."""
        return self._last_handle

    def save_state(
        self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True, **_: Any
    ) -> str:
        """Replaces ``Accelerator.save_state``; returns the checkpoint folder once the snapshot is scheduled.

        The folder gets the files stock ``save_state`` writes (``model.safetensors``, or ``pytorch_model.bin``
        with ``safe_serialization=False``, ``optimizer.bin``, ...) plus ``manifest.json``, written last.
        """
        self._check_open()
        started = time.perf_counter()
        self.log_stats()
        target = self._save_target(output_dir)
        checked = self._on_main(lambda: self._claim(target))  # its value: the folder's staging path, or None
        gathered = all_gather(
            self._accelerator, {"rng": rng_file_state(self._accelerator.step), "error": checked.wire_error}
        )
        checked.raise_shared(gathered[0]["error"])
        iteration = self._accelerator.project_configuration.iteration
        rngs = [g["rng"] for g in gathered]
        shared = self._shared and self._shared.save(self._accelerator, target, safe_serialization, rngs, iteration)
        if self._accelerator.is_main_process:
            # The folder must always show its latest save_state: an earlier save of it still pending would publish
            # its manifest (and drop the marker) after this call returned. Rare (one folder saved twice in a row).
            _wait_for_saves_of(naming.normalize(target.url))
            checkpointer = self._checkpointer_for(target.root)
            self._watchers[target.root].sync(self._accelerator._optimizers, self._accelerator._models)
            staging = checked.value
            # A staged folder's pre-hooks (register_save_state_pre_hook) write into it under its staging name too, so
            # that their files appear with the rest.
            files = shared or stock_files(self._accelerator, staging or target.url, safe_serialization, rngs)
            meta = {"format": NATIVE_FORMAT, "iteration": iteration, "step": self._accelerator.step,
                    "num_processes": self._accelerator.num_processes}
            # Each torch file is unpickled on the committer as load_state will read it, before the commit: a state
            # that saves but would be refused at the resume fails the save (logged then), naming the keys.
            loaders = save_loaders([n for n, (kind, _) in files.items() if kind == TORCH],
                                   self.config.allowed_classes, self.allow_unsafe_pickle)
            handle = checkpointer.save_files(files, target.name, step=iteration, user={META_KEY: meta},
                                            made=not naming.is_url(target.url), loaders=loaders,
                                            staged=staging is not None)
            self._in_flight = [h for h in self._in_flight if not h.done()] + [handle]
            self._last_handle = handle
        self._accelerator.project_configuration.iteration = iteration + 1
        self.save_state_ms.append((time.perf_counter() - started) * 1e3)
        return target.url

    def load_state(self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, *,
                   healthy: bool = False, **kwargs: Any) -> str:
        """Replaces ``Accelerator.load_state``; returns the folder it restored.

        Stock ``load_state`` restores the folder, its reads routed through ``fastload.FolderReader``: the model's
        safetensors read straight into its tensors, the torch files read whole and unpickled over those bytes,
        every byte checked against the manifest as it is read (``IntegrityError`` names a damaged file). ``load_kwargs`` other than
        ``weights_only`` take stock's reads, after a check of every file (``last_load_stats`` says which).
        ``healthy=True`` (no ``input_dir``): the newest checkpoint whose tensors hold no NaN or Inf."""
        self._check_open()
        started = time.perf_counter()
        path = self._main_decides(lambda: self._resolve_load_path(input_dir, healthy))
        options = self._storage_options(path)
        verify = self.config.persist.verify_on_load
        fast = set(load_kwargs or {}) <= {"weights_only"}  # anything else (mmap, encoding, ...): stock reads
        kind, manifest = self._main_decides(lambda: inspect_folder(path, options, verify and not fast))
        for ckpt in list(self._checkpointers.values()):  # loading writes parameters lazy copies may read
            ckpt.wait_staged()
        if kind == CORE:
            self._load_core(path, **kwargs)
            self.last_load_stats = LoadStateStats(path, kind, seconds=time.perf_counter() - started)
            return path
        with local_folder(path, options) as local:
            reader = None
            if fast:
                records = manifest.get("files") if kind == FILES else None
                reader = FolderReader(local, kind, records, workers=self.config.persist.workers, verify=verify,
                                      process_index=self._accelerator.process_index)

            def load() -> None:
                try:
                    self._load_foreign(local, load_kwargs, reader, **kwargs)
                except IntegrityError as e:
                    if isinstance(e, UnsafeCheckpointError):
                        raise
                    raise IntegrityError(f"checkpoint {path} is corrupt: {e}") from e

            # Every process loads; an error on one is raised on all (a lone failure would hang the others later).
            self._on_every_process(load)
            unlisted = unlisted_files(local, manifest) if kind == FILES and reader is None else []
        stats = reader.stats if reader is not None else LoadStateStats(
            path, kind, fallbacks={"*": f"load_kwargs {sorted(load_kwargs or {})}: stock reads"
                                         + (", after a check of every file" if verify and kind == FILES else "")
                                         + (f"; {', '.join(unlisted)} not in the manifest: stock may read them "
                                            "unchecked" if unlisted else "")},
            verified=verify and kind == FILES and not unlisted)
        stats.path, stats.seconds = path, time.perf_counter() - started
        self.last_load_stats = stats
        meta = (manifest.get("user") or {}).get(META_KEY) if kind == FILES else None
        iteration = meta.get("iteration") if isinstance(meta, dict) else None
        if iteration is None:
            iteration = naming.iteration_from_name(os.path.basename(path))
        if isinstance(iteration, int):  # Accelerate forgets this (issues #1601, #3306): the next save would reuse it
            self._accelerator.project_configuration.iteration = iteration + 1
        return path

    def _load_core(self, path: str, **kwargs: Any) -> str:
        """A checkpoint in the core layout, written by fastckpt_accelerate before the native format."""
        state = self._read(path)
        meta = read_meta(state, path)
        kwargs.pop("map_location", None)  # tensors load on CPU; load_state_dict moves them to each parameter
        restore_state(self._accelerator, state, path, **kwargs)
        if not restore_process_state(self._accelerator, state):
            logger.warning("%s has no RNG/dataloader state for process %d", path, self._accelerator.process_index)
        self._accelerator.step = int(meta["step"])
        self._accelerator.project_configuration.iteration = int(meta["iteration"]) + 1
        return path

    def list(self) -> list[Any]:
        """``CheckpointInfo`` of every committed checkpoint under the configured root, oldest first; the main
        process lists and every process gets its answer (call it on every process)."""
        self._check_open()
        return self._main_decides(lambda: sorted(self._checkpointer_for(self.root).list(), key=lambda i: i.step))

    def latest(self, *, healthy: bool = False) -> int | None:
        """The newest committed step (with ``healthy``, of a checkpoint without NaN or Inf), or None."""
        return getattr(newest_or_none(self.list(), healthy), "step", None)

    def wait(self) -> None:
        """Block until every pending save is committed; raises a background error (once)."""
        for ckpt in list(self._checkpointers.values()):
            ckpt.wait()
        self.log_stats()

    def wait_for_everyone(self) -> None:
        """Replaces ``Accelerator.wait_for_everyone``: every pending save commits first (its files and manifest are
        complete once this returns, on every process: the main process waits before the barrier), then stock's
        barrier. A background error is raised on the main process after the barrier (the others are not held)."""
        error: FastCkptError | None = None
        if not self._closed:
            try:
                self.wait()
            except FastCkptError as e:
                error = e
        if self._original_wait_for_everyone is not None:
            self._original_wait_for_everyone()
        if error is not None:
            raise error

    def log_stats(self) -> int:
        """Send the stats of saves finished since the last call to ``accelerator.log`` (if enabled)."""
        if self._stats_logger is None:
            return 0
        return self._stats_logger.log_new(self.stats)

    def close(self) -> None:
        """Flush pending saves and stop the Checkpointers; idempotent. Raises the first background error."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        first_error = close_all(self._checkpointers, self._watchers)
        try:
            self.log_stats()
        finally:
            self._checkpointers.clear()
        if first_error is not None:
            raise first_error

    # ----------------------------------------------------------------- save helpers

    def _save_target(self, output_dir: str | os.PathLike | None) -> naming.CheckpointTarget:
        project = self._accelerator.project_configuration
        if project.automatic_checkpoint_naming or output_dir is None:
            # Accelerate ignores output_dir under automatic naming; so do we.
            return naming.CheckpointTarget(self.root, naming.checkpoint_name(project.iteration))
        return naming.split(output_dir)

    def _claim(self, target: naming.CheckpointTarget) -> str | None:
        """Main process: raise if automatic naming would reuse a checkpoint name, as Accelerate does; create the
        folder, as Accelerate does, or (``complete_folders``, a local folder that does not exist yet) its staging
        folder, whose path is returned (None: the folder itself is written).

        An explicit ``output_dir`` may be saved again (Accelerate overwrites it): the new manifest replaces
        the old one atomically at commit, so the folder always holds one complete checkpoint.
        """
        if self._accelerator.project_configuration.automatic_checkpoint_naming:
            checkpointer = self._checkpointer_for(target.root)
            pending = any(h.name == target.name and not h.done() for h in self._in_flight)
            if pending or checkpointer.exists(target.name):
                iteration = self._accelerator.project_configuration.iteration
                raise ConfigError(
                    f"checkpoint {target.url} already exists (iteration {iteration}); "
                    "load_state() to continue from the newest checkpoint, or set "
                    "accelerator.project_configuration.iteration past it"
                )
        if naming.is_url(target.url):
            return None
        if self.complete_folders:
            _wait_for_saves_of(naming.normalize(target.url))  # a pending save of this folder owns its staging folder
            staging = stage(target.url)
            if staging is not None:
                return staging
        os.makedirs(target.url, exist_ok=True)  # as Accelerate: the folder exists once save_state returns
        return None

    def _checkpointer_for(self, root: str) -> Checkpointer:
        """The Checkpointer of ``root`` (main process). It takes no root lock: ``save_files`` never does, the
        folders are Accelerate's (several Accelerators may share a project_dir, as with stock)."""
        if root not in self._checkpointers:
            if root == self.root:
                checkpointer = Checkpointer(self.config, storage=self._storage)
            else:
                # Explicit output_dir folders elsewhere: same settings, but retention (total_limit) only
                # applies to the automatic checkpoints under the configured root.
                # Nor is the remote tier theirs: remote.url mirrors the configured root only, so an explicit
                # folder's checkpoint could never shadow (or be shadowed by) an automatic one of the same name.
                retention = replace(self.config.retention, keep_last=None, keep_every_n_steps=None)
                checkpointer = Checkpointer(replace(self.config, root=root, retention=retention,
                                                    remote=RemoteOptions()))
            self._checkpointers[root] = checkpointer
            self._watchers[root] = OptimizerWatcher(checkpointer)
        return self._checkpointers[root]

    # ----------------------------------------------------------------- load helpers

    def _resolve_load_path(self, input_dir: str | os.PathLike | None, healthy: bool = False) -> str:
        """Main process: the checkpoint to load, after pending saves commit."""
        self.wait()
        if input_dir is not None:
            path = naming.normalize(input_dir)
            _wait_for_saves_of(path)
            return path
        _wait_for_saves_of(self.root, under=True)
        return newest(self._checkpointer_for(self.root).list(), self.root, healthy).path

    def _read(self, path: str) -> dict[str, Any]:
        try:
            return load_checkpoint(
                path,
                map_location="cpu",
                storage_options=self._storage_options(path),
                verify=self.config.persist.verify_on_load,
                allowed_classes=self.config.allowed_classes,
            )
        except IntegrityError as e:
            raise IntegrityError(
                f"checkpoint {path} is corrupt ({e}); load an older one with accelerator.load_state(<path>)"
            ) from e

    def _load_foreign(self, path: str, load_kwargs: dict | None, reader: FolderReader | None,
                      **kwargs: Any) -> str:
        """A folder of Accelerate's files (native or stock): stock ``load_state``, reading through ``reader``."""
        if naming.is_url(path) or not os.path.isdir(path) or not _looks_like_accelerate(path):
            raise CheckpointNotFoundError(
                f"{path} is not a committed fastckpt checkpoint (no manifest: missing, or its save never "
                "finished) and not a folder written by Accelerate's save_state"
            )
        assert self._original_load_state is not None
        if reader is not None:
            reader.precheck()  # every file but the model's weights, before anything is loaded
        load_accelerate_folder(self._original_load_state, path, load_kwargs, self.allow_unsafe_pickle, reader,
                               self.config.allowed_classes, **kwargs)
        iteration = naming.iteration_from_name(os.path.basename(path))
        if iteration is not None:
            self._accelerator.project_configuration.iteration = iteration + 1
        return path

    def _storage_options(self, path: str) -> dict | None:
        remote = self.config.remote
        if remote.url is not None and _under(path, remote.url):
            return dict(remote.storage_options)  # a checkpoint only the remote tier still holds
        return dict(self.config.storage_options or {}) if naming.is_url(path) else None

    # ----------------------------------------------------------------- plumbing

    def _main_decides(self, decide: Callable[[], str]) -> str:
        """Run ``decide`` on the main process and share its result, or its error, with every process."""
        outcome = self._on_main(decide)
        value, wire_error = broadcast_from_main(self._accelerator, (outcome.value, outcome.wire_error))
        outcome.raise_shared(wire_error)
        return value

    def _on_every_process(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on every process; if it raised on any, raise on all (one small collective)."""
        error: Exception | None = None
        try:
            fn()
        except Exception as e:  # shared below, then re-raised as it is
            error = e
        wires = all_gather(self._accelerator, None if error is None else (type(error).__name__, str(error)))
        if error is not None:
            raise error
        for rank, wire in enumerate(wires):
            if wire is not None:
                raise remote_error(rank, *wire)

    def _on_main(self, fn: Callable[[], Any]) -> "Outcome":
        if not self._accelerator.is_main_process:
            return Outcome()
        try:
            return Outcome(value=fn())
        except FastCkptError as e:
            # Not raised yet: the other processes are about to enter a collective and must learn of it.
            return Outcome(error=e)

    def _check_open(self) -> None:
        if self._closed:
            raise FastCkptError(
                "fastckpt checkpointing for this Accelerator was closed (end_training() or close()); "
                "call fastckpt_accelerate.enable(accelerator, config) again to keep saving"
            )


def _close_at_exit(ref: "weakref.ref[FastAccelerateCheckpointing]") -> None:
    checkpointing = ref()
    if checkpointing is None or checkpointing.closed:
        return
    try:
        checkpointing.close()
    except Exception:  # at exit nobody can catch it: make the lost checkpoint loud
        logger.exception("fastckpt: a checkpoint failed to persist before the process exited")


def _wait_for_saves_of(path: str, *, under: bool = False) -> None:
    """Let the pending saves of ``path`` (``under``: of any folder under it) by any Accelerator of this process commit (a new Accelerator resuming
    from the folder an earlier one just saved, as stock allows); their errors stay theirs to raise."""
    for other in list(_LIVE):
        for handle in list(other._in_flight):
            saved = naming.normalize(handle.path)
            if (saved == path or (under and _under(saved, path))) and not handle.done():
                handle.blocking()
                concurrent.futures.wait([handle.durable])  # not wait(): its error stays its owner's to raise


def _looks_like_accelerate(path: str) -> bool:
    names = os.listdir(path)
    return any(n.startswith(("random_states_", "optimizer", "model", "pytorch_model")) for n in names)


def _under(path: str, url: str) -> bool:
    """Whether ``path`` is ``url`` or inside it (URLs compared as strings, trailing slashes ignored)."""
    base = url.rstrip("/")
    return path.rstrip("/") == base or path.startswith(base + "/")
