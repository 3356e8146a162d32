"""``FastDDPStrategy``: Lightning's ``DDPStrategy`` with every rank sharing the writes of each ``.ckpt``.

Lightning calls ``CheckpointIO.save_checkpoint`` on global rank 0 only and then enters a barrier on every rank, so a
plugin cannot bring the other ranks into a save: a collective started on rank 0 would wait for ranks sitting in the
barrier. ``Trainer.save_checkpoint`` runs on every rank, though (``dump_checkpoint``, then
``strategy.save_checkpoint``, then the barrier), so this subclass enters the save on every rank, with the path,
before the barrier. Each rank then writes its share of the one torch file (``fastckpt.engine.sharedfile``; on
``s3://`` its parts of one multipart upload, ``fastckpt.engine.sharedobject``): the
parameters and optimizer state, which DDP keeps identical on every rank, split by bytes; everything else (buffers
such as BatchNorm's running statistics, which differ per rank, and the pickled loop and callback state) is rank 0's,
as in a stock save. Rank 0 commits the file once every rank's part is durable.

Everything else stays stock: rank 0 removes old files (through the plugin, behind pending saves), ``ModelCheckpoint``
names and versions them, and the file is the genuine torch file ``torch.load`` and ``load_from_checkpoint`` read.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from fastckpt.errors import ConfigError
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy

from fastckpt_lightning.owner import FastIOOwner

__all__ = ["FastDDPStrategy"]


class FastDDPStrategy(FastIOOwner, DDPStrategy):
    """``Trainer(strategy=FastDDPStrategy(), plugins=[FastCheckpointIO(...)])``; the arguments of ``DDPStrategy``
    plus ``shared_writes``:

    - ``None`` (auto): the ranks share the writes when the checkpoint path is ``s3://`` (each rank uploads its parts
      of one multipart upload, on any node), or local with every rank on one node; otherwise rank 0 writes the file
      alone, as with ``DDPStrategy``;
    - ``True``: share them for every local path, also across nodes (the folder must be one shared POSIX file
      system every rank writes into), and on ``s3://``; another remote path (``gs://``...) raises ``ConfigError``;
    - ``False``: rank 0 writes alone, as with ``DDPStrategy`` and the plugin.

    Without a ``FastCheckpointIO`` plugin, one with default settings is used.
    """

    def __init__(self, *args: Any, shared_writes: Optional[bool] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if shared_writes not in (None, True, False):
            raise ConfigError(f"FastDDPStrategy(shared_writes={shared_writes!r}): use None (auto), True or False")
        self.shared_writes = shared_writes

    def shares(self, path: str) -> bool:
        """Whether the ranks share the writes of the file ``path`` (the same answer on every rank)."""
        if self.world_size < 2 or self.shared_writes is False:
            return False
        if path.startswith(("s3://", "s3a://")):  # every rank uploads its parts of one object, on any node
            return True
        remote = "://" in path and not path.startswith("file://")
        if remote:
            if self.shared_writes:
                raise ConfigError(
                    f"FastDDPStrategy(shared_writes=True) cannot share the writes of {path!r}: only S3 takes the "
                    "parts of one object from several writers. Use shared_writes=None (rank 0 uploads it alone), an "
                    "s3:// path or a local dirpath")
            return False
        return bool(self.shared_writes) or self.num_nodes == 1

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Every rank: enter the shared save of ``filepath`` (named by rank 0) and return; the file appears once
        every rank's part is durable. Where the ranks do not share, rank 0 saves alone (the parent class)."""
        io = self.fast_io  # set before the parent's rank-0 save too: one plugin saves, removes and loads
        path = os.fspath(self.broadcast(os.fspath(filepath)))  # rank 0 names it, as a stock save does
        if not self.shares(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        self.refuse_storage_options(storage_options)
        assert self.lightning_module is not None
        io.save_shared(checkpoint, path.removeprefix("file://"), self.lightning_module.trainer)
