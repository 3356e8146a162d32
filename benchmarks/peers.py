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
* torchsnapshot ``Snapshot.async_take``: stages (copies) the state synchronously inside the call, then writes
  on its own event loop; the previous snapshot is awaited (``PendingSnapshot.wait``) before the next one. It
  needs a process group for its store: a one-rank gloo group, as in any distributed job.
* DLRover Flash Checkpoint (``DdpCheckpointer.save_checkpoint(..., StorageType.DISK)``): copies the state into
  shared memory synchronously; its saver persists it in the background (started in-process when the job is
  not launched by ``dlrover-run``). Flush = its tracker file names the step, polled every 10 ms (its own
  ``wait_latest_checkpoint`` polls every 3 s, which would bill up to 3 s of sleep to DLRover).
* ByteCheckpoint ``bytecheckpoint.save(..., framework="ddp", fast_saving=True)``: takes the model and optimizer
  objects, stages synchronously, writes in the background; flush = its completion callback. One-rank gloo group.
* fastckpt: ``Checkpointer.watch(optimizer)`` (lazy mode); its optimizer step pre-hook waits for staging.
  Nothing is awaited in the loop.

torchsnapshot, DLRover and ByteCheckpoint are optional (``Peer.missing()`` says what to install); their
PyPI requirements would replace the CPU torch wheel, so they are installed with ``--no-deps`` (BENCHMARKS.md).
DataStates-LLM is not on PyPI and is not measured.
"""
from __future__ import annotations

import os
import socket
import threading
import time
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

    @classmethod
    def missing(cls) -> str | None:
        """Why this peer cannot run here (a package to install), or None."""
        return None


def _import_error(module: str, install: str) -> str | None:
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure means the peer cannot run
        return f"not installed ({type(e).__name__}: {e}); pip install --no-deps {install}"
    return None


def _one_rank_group() -> None:
    """A one-process gloo group: what the distributed-first peers expect to find."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


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


class TorchSnapshot(Peer):
    name = "torchsnapshot"
    label = "torchsnapshot async_take"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        _one_rank_group()
        from torchsnapshot import Snapshot, StateDict

        self.snapshot, self.wrap = Snapshot, StateDict
        self.pending: Any = None

    def save(self, state: dict, step: int) -> None:
        if self.pending is not None:
            self.pending.wait()
        self.pending = self.snapshot.async_take(str(self.root / f"step-{step:09d}"), {"state": self.wrap(**state)})

    def flush(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    @classmethod
    def missing(cls) -> str | None:
        return _import_error("torchsnapshot", "torchsnapshot-nightly==2024.7.26 aiofiles nest_asyncio "
                                              "pyre-extensions typing-inspect mypy-extensions 'importlib_metadata<8'")


class DlroverFlash(Peer):
    name = "dlrover_flash"
    label = "DLRover Flash Checkpoint"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        self.ck = DdpCheckpointer(str(self.root))
        self.disk = StorageType.DISK
        self.last: int | None = None

    def save(self, state: dict, step: int) -> None:
        self.flush()  # its shared-memory buffer is reused: a save while the saver still reads it is skipped
        step += 1  # DLRover 0.6.1 never persists step 0 (its saver sees zero ready shards and times out)
        self.ck.save_checkpoint(step, state, str(self.root / f"step-{step:09d}.pt"), storage_type=self.disk)
        self.last = step

    def flush(self) -> None:
        if self.last is None:
            return
        tracker = self.root / "dlrover_latest.txt"  # the saver writes the step here once it is on disk
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if int(tracker.read_text().strip() or -1) == self.last:
                    self.last = None
                    return
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.01)
        raise TimeoutError(f"DLRover did not persist step {self.last} within 600 s")

    def close(self) -> None:
        self.flush()
        close = getattr(self.ck, "close", None)
        if callable(close):
            close()

    @classmethod
    def missing(cls) -> str | None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Outside dlrover-run it starts its saver only in a process without a process group (with one it
            # waits for an agent that does not exist): another peer ran in this process (--quick runs inline).
            return "needs a fresh process (run without --quick, or with --isolate)"
        return _import_error("dlrover.trainer.torch.flash_checkpoint.ddp", "dlrover==0.6.1")


class ByteCheckpoint(Peer):
    name = "bytecheckpoint"
    label = "ByteCheckpoint fast_saving"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        _one_rank_group()
        import bytecheckpoint

        self.bcp = bytecheckpoint
        self.done: threading.Event | None = None
        self.objects: dict[str, Any] = {}

    def attach(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.objects = {"model": model, "optimizer": opt}  # it saves objects, not a state dict

    def save(self, state: dict, step: int) -> None:
        self.flush()
        done = threading.Event()
        self.bcp.save(str(self.root), self.objects, framework="ddp", fast_saving=True, global_steps=step,
                      callback=lambda *_: done.set())
        self.done = done

    def flush(self) -> None:
        if self.done is not None:
            if not self.done.wait(600):
                raise TimeoutError("ByteCheckpoint did not report completion within 600 s")
            self.done = None

    @classmethod
    def missing(cls) -> str | None:
        return _import_error("bytecheckpoint", "bytecheckpoint==0.0.2")


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


PEERS: dict[str, type[Peer]] = {p.name: p for p in (TorchSave, LightningAsync, DcpDefault, DcpStager, TorchSnapshot,
                                                     DlroverFlash, ByteCheckpoint, Fastckpt)}
ORDER = [TorchSave.name, LightningAsync.name, DcpDefault.name, DcpStager.name, TorchSnapshot.name, DlroverFlash.name,
         ByteCheckpoint.name, Fastckpt.name]
LABELS = {name: cls.label for name, cls in PEERS.items()}


def make(name: str, root: Path) -> Peer:
    return PEERS[name](root)
