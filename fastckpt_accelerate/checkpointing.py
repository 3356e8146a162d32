"""``FastAccelerateCheckpointing``: what ``accelerator.save_state``/``load_state`` do once fastckpt is enabled.

Save, on every process (Accelerate already requires every process to call ``save_state``):

1. pick the target (``checkpoint_{iteration}`` under the root, or the given ``output_dir``);
2. gather every process's RNG and dataloader states to every process (one small collective);
3. hand the whole state to ``Checkpointer.save``, which returns in milliseconds: tensors are copied in the
   background, and the watched optimizers' ``step()`` waits until they are. With DDP and storage every
   process can write (``distributed.can_share_writes``), every process does this with a distributed
   ``Checkpointer``: the replicated parameters and optimizer state are split between the processes, each
   copies and writes its part, and rank 0 commits; state the forward pass changes (BatchNorm buffers) and
   the non-tensor values are rank 0's, as with Accelerate. Otherwise the main process saves everything;
4. ``project_configuration.iteration`` advances, as in Accelerate.

Load: the main process picks the checkpoint (after letting pending saves commit), every process reads it
and restores its own RNG and dataloader state, and ``iteration`` moves past the loaded checkpoint.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable

from accelerate import Accelerator

import fastckpt.errors as errors
from fastckpt import CheckpointConfig, Checkpointer, RemoteOptions, is_checkpoint, load_checkpoint
from fastckpt.errors import CheckpointNotFoundError, ConfigError, FastCkptError, IntegrityError, StateMismatchError
from fastckpt.exithook import register_exit_hook

from . import naming
from .distributed import all_gather, broadcast_from_main, can_share_writes
from .foreign import load_accelerate_folder
from .state import capture_process_state, capture_state, read_meta, restore_process_state, restore_state
from .stats import StatsLogger
from .watcher import OptimizerWatcher

logger = logging.getLogger(__name__)


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
    ) -> None:
        self._closed = True  # until construction succeeds, so close() is safe on a half-built object
        self._accelerator = accelerator
        self.config = config
        self.root = naming.normalize(config.root)
        self._storage = storage
        self._original_load_state = original_load_state
        self.allow_unsafe_pickle = bool(allow_unsafe_pickle)  # see foreign.py: Accelerate folders' pickles
        self._checkpointers: dict[str, Checkpointer] = {}
        self._watchers: dict[str, OptimizerWatcher] = {}
        self._stats_logger = StatsLogger(accelerator) if log_stats else None
        self._in_flight: list[Any] = []  # SaveHandles not known to be finished (pruned at each save)
        self._last_handle: Any | None = None
        self.save_state_ms: list[float] = []
        possible = can_share_writes(accelerator, self.root)
        if shared_writes and not possible:
            raise ConfigError(
                f"shared_writes=True, but the processes cannot share the writes under {self.root}: that needs "
                "several processes (torch.distributed initialized), and a root every process can write for rank 0 "
                "to commit (an s3:// URL, or a local path with every process on one node); pass shared_writes=None"
            )
        self.shared_writes = possible if shared_writes is None else bool(shared_writes)
        if self.shared_writes and storage is not None:
            raise ConfigError("storage= injects one process's Storage; it cannot be combined with shared_writes")
        if accelerator.is_main_process or self.shared_writes:
            self._checkpointer_for(self.root)
        self._closed = False
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
        """Replaces ``Accelerator.save_state``; returns the checkpoint URL once the snapshot is scheduled.

        ``safe_serialization`` and the model-saving kwargs are accepted for compatibility: fastckpt always
        writes safetensors shards and never pickles models.
        """
        self._check_open()
        started = time.perf_counter()
        self.log_stats()
        target = self._save_target(output_dir)
        checked = self._on_main(lambda: self._claim(target))
        gathered = all_gather(
            self._accelerator, {"process": capture_process_state(self._accelerator), "error": checked.wire_error}
        )
        checked.raise_shared(gathered[0]["error"])
        iteration = self._accelerator.project_configuration.iteration
        shared = self._shares(target.root)
        if self._accelerator.is_main_process or shared:
            checkpointer = self._checkpointer_for(target.root)
            self._watchers[target.root].sync(self._accelerator._optimizers)
            state = capture_state(self._accelerator, iteration, [g["process"] for g in gathered])
            try:
                handle = checkpointer.save(state, step=iteration, name=target.name)
            except StateMismatchError as e:
                if not shared:
                    raise
                raise StateMismatchError(
                    f"{e}. The processes share the writes of each checkpoint (shared_writes), so every process "
                    "must hold state of the same shapes; enable(..., shared_writes=False) lets the main "
                    "process save its own state alone, as Accelerate does"
                ) from e
            self._in_flight = [h for h in self._in_flight if not h.done()] + [handle]
            self._last_handle = handle
        self._accelerator.project_configuration.iteration = iteration + 1
        self.save_state_ms.append((time.perf_counter() - started) * 1e3)
        return target.url

    def load_state(
        self, input_dir: str | os.PathLike | None = None, load_kwargs: dict | None = None, **kwargs: Any
    ) -> str:
        """Replaces ``Accelerator.load_state``; returns the URL of the checkpoint it restored."""
        self._check_open()
        path = self._main_decides(lambda: self._resolve_load_path(input_dir))
        options = self._storage_options(path)
        if not is_checkpoint(path, storage_options=options):
            return self._load_foreign(path, load_kwargs, **kwargs)
        state = self._read(path)
        meta = read_meta(state, path)
        kwargs.pop("map_location", None)  # tensors load on CPU; load_state_dict moves them to each parameter
        for ckpt in list(self._checkpointers.values()):  # restore_state writes parameters lazy copies may read
            ckpt.wait_staged()
        restore_state(self._accelerator, state, path, **kwargs)
        if not restore_process_state(self._accelerator, state):
            logger.warning("%s has no RNG/dataloader state for process %d", path, self._accelerator.process_index)
        self._accelerator.step = int(meta["step"])
        # Accelerate forgets this (issues #1601, #3306); without it the next save would reuse a name.
        self._accelerator.project_configuration.iteration = int(meta["iteration"]) + 1
        return path

    def wait(self) -> None:
        """Block until every pending save is committed; raises a background error (once)."""
        for ckpt in list(self._checkpointers.values()):
            ckpt.wait()
        self.log_stats()

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
        first_error: BaseException | None = None
        for root, ckpt in list(self._checkpointers.items()):
            try:
                ckpt.wait()
            except BaseException as e:  # keep closing the others; report the first failure
                first_error = first_error or e
            finally:
                self._watchers.pop(root).remove()
                ckpt.close()
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

    def _claim(self, target: naming.CheckpointTarget) -> None:
        """Main process: raise if automatic naming would reuse a checkpoint name, as Accelerate does.

        An explicit ``output_dir`` may be saved again (Accelerate overwrites it): the new manifest replaces
        the old one atomically at commit, so the folder always holds one complete checkpoint.
        """
        if not self._accelerator.project_configuration.automatic_checkpoint_naming:
            return
        checkpointer = self._checkpointer_for(target.root)
        pending = any(h.name == target.name and not h.done() for h in self._in_flight)
        if pending or checkpointer.exists(target.name):
            iteration = self._accelerator.project_configuration.iteration
            raise ConfigError(
                f"checkpoint {target.url} already exists (iteration {iteration}); "
                "load_state() to continue from the newest checkpoint, or set "
                "accelerator.project_configuration.iteration past it"
            )

    def _shares(self, root: str) -> bool:
        """Whether every process writes its part of the checkpoints under ``root`` (the same on every process)."""
        return self.shared_writes and (root == self.root or can_share_writes(self._accelerator, root))

    def _checkpointer_for(self, root: str) -> Checkpointer:
        """The Checkpointer of ``root``; when ``_shares(root)`` every process must call this together."""
        if root not in self._checkpointers:
            if root == self.root:
                checkpointer = Checkpointer(self.config, storage=self._storage, distributed=self.shared_writes)
            else:
                # Explicit output_dir folders elsewhere: same settings, but retention (total_limit) only
                # applies to the automatic checkpoints under the configured root.
                # Nor is the remote tier theirs: remote.url mirrors the configured root only, so an explicit
                # folder's checkpoint could never shadow (or be shadowed by) an automatic one of the same name.
                retention = replace(self.config.retention, keep_last=None, keep_every_n_steps=None)
                checkpointer = Checkpointer(replace(self.config, root=root, retention=retention,
                                                    remote=RemoteOptions()), distributed=self._shares(root))
            self._checkpointers[root] = checkpointer
            self._watchers[root] = OptimizerWatcher(checkpointer)
        return self._checkpointers[root]

    # ----------------------------------------------------------------- load helpers

    def _resolve_load_path(self, input_dir: str | os.PathLike | None) -> str:
        """Main process: the checkpoint to load, after pending saves commit."""
        self.wait()
        if input_dir is not None:
            return naming.normalize(input_dir)
        infos = self.checkpointer.list()
        if not infos:
            raise CheckpointNotFoundError(
                f"no committed fastckpt checkpoint under {self.root}; pass load_state(path) to load another one"
            )
        return max(infos, key=lambda info: info.step).path

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

    def _load_foreign(self, path: str, load_kwargs: dict | None, **kwargs: Any) -> str:
        """A folder written by Accelerate itself: delegate, then fix the iteration Accelerate forgets."""
        if naming.is_url(path) or not os.path.isdir(path) or not _looks_like_accelerate(path):
            raise CheckpointNotFoundError(
                f"{path} is not a committed fastckpt checkpoint (no manifest: missing, or its save never "
                "finished) and not a folder written by Accelerate's save_state"
            )
        assert self._original_load_state is not None
        load_accelerate_folder(self._original_load_state, path, load_kwargs, self.allow_unsafe_pickle, **kwargs)
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

    def _on_main(self, fn: Callable[[], Any]) -> "_Outcome":
        if not self._accelerator.is_main_process:
            return _Outcome()
        try:
            return _Outcome(value=fn())
        except FastCkptError as e:
            # Not raised yet: the other processes are about to enter a collective and must learn of it.
            return _Outcome(error=e)

    def _check_open(self) -> None:
        if self._closed:
            raise FastCkptError(
                "fastckpt checkpointing for this Accelerator was closed (end_training() or close()); "
                "call fastckpt_accelerate.enable(accelerator, config) again to keep saving"
            )


@dataclass
class _Outcome:
    """What a main-process-only step produced, in a form every process can act on."""

    value: Any = None
    error: FastCkptError | None = None

    @property
    def wire_error(self) -> tuple[str, str] | None:
        """The error as (class name, message): picklable for the collectives."""
        return None if self.error is None else (type(self.error).__name__, str(self.error))

    def raise_shared(self, wire_error: tuple[str, str] | None) -> None:
        """Raise on every process if the main one failed: the original error where it happened."""
        if self.error is not None:
            raise self.error
        if wire_error is not None:
            name, message = wire_error
            cls = getattr(errors, name, FastCkptError)
            if not (isinstance(cls, type) and issubclass(cls, FastCkptError)):
                cls = FastCkptError
            raise cls(f"on the main process: {message}")


def _close_at_exit(ref: "weakref.ref[FastAccelerateCheckpointing]") -> None:
    checkpointing = ref()
    if checkpointing is None or checkpointing.closed:
        return
    try:
        checkpointing.close()
    except Exception:  # at exit nobody can catch it: make the lost checkpoint loud
        logger.exception("fastckpt: a checkpoint failed to persist before the process exited")


def _looks_like_accelerate(path: str) -> bool:
    names = os.listdir(path)
    return any(n.startswith(("random_states_", "optimizer", "model", "pytorch_model")) for n in names)


def _under(path: str, url: str) -> bool:
    """Whether ``path`` is ``url`` or inside it (URLs compared as strings, trailing slashes ignored)."""
    base = url.rstrip("/")
    return path.rstrip("/") == base or path.startswith(base + "/")
