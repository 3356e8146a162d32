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

from fastckpt_lightning.pointer import PointerStore, join_path

log = logging.getLogger("fastckpt")

_LAST = re.compile(rf"^{ModelCheckpoint.CHECKPOINT_NAME_LAST}(-v\d+)?{re.escape(ModelCheckpoint.FILE_EXTENSION)}$")


class FastModelCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also resumes from ``ckpt_path="last"`` on ``s3://`` and other remote folders.

    Without a ``dirpath`` it uses the ``root`` of the trainer's ``FastCheckpointIO`` (when one is set). Everything
    else is ``ModelCheckpoint``, unchanged.
    """

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Adopt the plugin's root before Lightning resolves the folder."""
        self._adopt_plugin_root(trainer)
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
