"""One adapter per checkpointing approach, all driven the same way by the plain training loop.

Protocol (see ``measure.core_loop``)::

    peer.attach(model, opt)          # once, before training
    peer.save(state, step)           # the call timed as "save() blocks"
    peer.before_optimizer_step()     # right before every opt.step(): wait for whatever must finish
                                     # before the parameters/optimizer state are mutated
    peer.flush()                     # every pending checkpoint durable/complete
    peer.close()

Each adapter waits for exactly what its own documentation requires before the next mutation, and no more:

* ``torch.save``: synchronous; nothing pending (note: torch.save does not fsync).
* Lightning ``AsyncCheckpointIO(TorchCheckpointIO())``: clones every tensor synchronously inside
  ``save_checkpoint`` and writes on a 1-thread executor; nothing to wait for before the next step.
* DCP ``async_save`` (default): stages (copies) synchronously inside the call and uploads on a thread.
  The previous upload is awaited before the next save, as the DCP docs recommend.
* DCP ``async_save`` + a reused ``DefaultStager`` (async staging): the staging future is awaited right
  before ``optimizer.step()``; the previous upload is awaited before the next save (the stager reuses its
  cached host storages, so a new staging must not overwrite a buffer still being written).
* fastckpt: ``Checkpointer.watch(optimizer)`` (lazy mode); its optimizer step pre-hook waits for staging.
  Nothing is awaited in the loop.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


class Peer:
    name = "?"
    label = "?"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def attach(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        pass

    def save(self, state: dict, step: int) -> None:
        raise NotImplementedError

    def before_optimizer_step(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.flush()

    def figures(self) -> dict[str, list[float]]:
        """The peer's own per-save figures, where it reports any (fastckpt's ``SaveStats``)."""
        return {}


class TorchSave(Peer):
    name = "torch_save"
    label = "torch.save"

    def save(self, state: dict, step: int) -> None:
        torch.save(state, self.root / f"step-{step:09d}.pt")


class LightningAsync(Peer):
    name = "lightning_async"
    label = "Lightning AsyncCheckpointIO"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, state: dict, step: int) -> None:
        self.io.save_checkpoint(state, str(self.root / f"step-{step:09d}.ckpt"))

    def flush(self) -> None:
        self.io.teardown()  # shuts the executor down after the queued writes; recreated on the next save


class DcpDefault(Peer):
    name = "dcp_default"
    label = "DCP async_save"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.upload: Any = None

    def save(self, state: dict, step: int) -> None:
        if self.upload is not None:
            self.upload.result()
        # torch 2.13 runs async_save without a process group (single-process mode); no_dist=True says so
        # explicitly instead of printing a warning per call.
        self.upload = self.dcp.async_save(state, checkpoint_id=str(self.root / f"step-{step:09d}"), no_dist=True)

    def flush(self) -> None:
        if self.upload is not None:
            self.upload.result()
            self.upload = None


class DcpStager(Peer):
    name = "dcp_stager"
    label = "DCP async_save + DefaultStager"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.dcp = dcp
        # CPU-only box: no pinned memory / non-blocking copies (they need an accelerator); no shared memory
        # (the uploader is a thread, not a process). Staging runs on the stager's own thread and reuses its
        # cached host storages from one checkpoint to the next.
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=False))
        self.resp: Any = None

    def save(self, state: dict, step: int) -> None:
        if self.resp is not None:
            self.resp.upload_completion.result()
        self.resp = self.dcp.async_save(state, checkpoint_id=str(self.root / f"step-{step:09d}"),
                                        async_stager=self.stager, no_dist=True)

    def before_optimizer_step(self) -> None:
        if self.resp is not None:
            self.resp.staging_completion.result()

    def flush(self) -> None:
        if self.resp is not None:
            self.resp.staging_completion.result()
            self.resp.upload_completion.result()
            self.resp = None

    def close(self) -> None:
        self.flush()
        self.stager.close()


class Fastckpt(Peer):
    name = "fastckpt"
    label = "fastckpt"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        from fastckpt import CheckpointConfig, Checkpointer

        self.ckpt = Checkpointer(CheckpointConfig(root=os.fspath(self.root)))
        self.last: Any = None

    def attach(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.ckpt.watch(opt)  # lazy mode: the step pre-hook waits for staging

    def save(self, state: dict, step: int) -> None:
        self.last = self.ckpt.save(state, step)

    def flush(self) -> None:
        self.ckpt.wait()

    def close(self) -> None:
        self.ckpt.close()

    def figures(self) -> dict[str, list[float]]:
        stats = self.ckpt.stats[1:]  # the first is the untimed warm-up save
        return {"waited_ms": [s.waited_ms for s in stats], "staging_ms": [s.staging_ms for s in stats],
                "persist_s": [s.persist_s for s in stats]}


PEERS: dict[str, type[Peer]] = {p.name: p for p in (TorchSave, LightningAsync, DcpDefault, DcpStager, Fastckpt)}
ORDER = [TorchSave.name, LightningAsync.name, DcpDefault.name, DcpStager.name, Fastckpt.name]
LABELS = {name: cls.label for name, cls in PEERS.items()}


def make(name: str, root: Path) -> Peer:
    return PEERS[name](root)
