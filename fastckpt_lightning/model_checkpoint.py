"""``FastModelCheckpoint``: resuming from ``"last"`` in a remote folder.

Lightning 2.6 lists the checkpoint folder with ``fs.ls``, which returns remote paths without their protocol
(``bucket/run/last.ckpt``). It then opens them with the local file system, finds nothing, warns, and silently trains
from scratch. :class:`FastModelCheckpoint` puts the protocol back; :func:`find_last_checkpoint` is the same lookup
as a plain function for code that passes an explicit ``ckpt_path``.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

import lightning.pytorch as pl
from fastckpt import open_storage
from fastckpt.errors import IntegrityError
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint

from fastckpt_lightning.cadence import CadenceTrigger
from fastckpt_lightning.pointer import PointerStore, join_path

log = logging.getLogger("fastckpt")

_LAST = re.compile(rf"^{ModelCheckpoint.CHECKPOINT_NAME_LAST}(-v\d+)?{re.escape(ModelCheckpoint.FILE_EXTENSION)}$")


class FastModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also resumes from ``ckpt_path="last"`` on ``s3://`` and other remote folders.

    Without a ``dirpath`` it uses the ``root`` of the trainer's ``FastCheckpointIO`` (when one is set). Everything
    else is ``ModelCheckpoint``, unchanged.

    ``every="auto"`` saves at the Young-Daly interval (docs/CADENCE.md) instead of ``every_n_train_steps`` (which,
    if given, is the baseline ``cadence_stats`` compares with); ``every=N`` every N steps; ``every_s`` when that
    many seconds passed. ``cadence``: the other ``CadenceOptions`` fields (``mtbf_s``, ``min_interval_s``...).
    """

    def __init__(self, *args: Any, every: int | str | None = None, every_s: float | None = None,
                 cadence: Any = None, **kwargs: Any) -> None:
        self._trigger: Optional[CadenceTrigger] = None
        if every is not None or every_s is not None or cadence is not None:
            self._trigger = CadenceTrigger(every, every_s, kwargs.get("every_n_train_steps"), cadence)
            kwargs["every_n_train_steps"] = 0  # the cadence decides the step saves; no epoch saves unless asked
        super().__init__(*args, **kwargs)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._trigger is None:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self._trigger.due(trainer, self.dirpath) or self._should_skip_saving_checkpoint(trainer):
            return None
        candidates = self._monitor_candidates(trainer)
        if self.monitor is not None and self.monitor not in candidates:
            self._defer_save_until_validation = True  # as stock: saved once validation logged the metric
            return None
        with self._trigger.timing():
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        if trainer.is_global_zero:
            self._trigger.seen()
        return None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self._trigger is not None and trainer.is_global_zero:
            self._trigger.end()

    @property
    def cadence_stats(self) -> Any:
        """What ``every`` / ``every_s`` chose and why (a ``fastckpt.CadenceStats``: interval, measured cost, MTBF,
        the work a failure loses now beside at ``every_n_train_steps``); None without them or before training."""
        return None if self._trigger is None else self._trigger.stats

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Adopt the plugin's root (and its YAML's ``cadence``, unless ``every`` was given) before Lightning resolves
        the folder."""
        self._adopt_plugin_root(trainer)
        plugin_cadence = getattr(getattr(trainer.strategy.checkpoint_io, "config", None), "cadence", None)
        if self._trigger is None and plugin_cadence is not None and (
                plugin_cadence.interval is not None or plugin_cadence.every_s is not None):
            self._trigger = CadenceTrigger(None, None, self._every_n_train_steps or None, plugin_cadence)
        super().setup(trainer, pl_module, stage)

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        # Called by Trainer.fit(ckpt_path="last") before setup().
        self._adopt_plugin_root(trainer)
        found = super()._find_last_checkpoints(trainer)
        if self.dirpath is None or _is_local_file_protocol(str(self.dirpath)):
            return found
        return {self._fs.unstrip_protocol(path) for path in found}

    def _adopt_plugin_root(self, trainer: pl.Trainer) -> None:
        if self.dirpath is not None:
            return
        root = getattr(getattr(trainer.strategy, "_checkpoint_io", None), "root", None)
        if root:
            self.dirpath = root
            self._fs = get_filesystem(root)


def find_last_checkpoint(dirpath: str, storage_options: Optional[dict[str, Any]] = None) -> Optional[str]:
    """The newest ``last*.ckpt`` in ``dirpath`` (local or remote), or None: pass it as ``fit(ckpt_path=...)``.

    Pointers are ranked by the step they record; a plain torch ``last.ckpt`` (no step) ranks lowest.
    """
    storage = open_storage(dirpath, storage_options)
    pointers = PointerStore(storage)
    ranked = []
    for name in storage.listdir(storage.url):
        if _LAST.match(name):
            try:
                pointer = pointers.read(name)
            except IntegrityError as e:  # one crafted pointer must not stop the resume
                log.warning("fastckpt: ignoring %s: %s", name, e)
                continue
            ranked.append((pointer.step if pointer is not None else -1, name))
    if not ranked:
        return None
    _, newest = max(ranked)
    return join_path(dirpath.rstrip("/"), newest)
