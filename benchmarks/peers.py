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
* torchsnapshot ``Snapshot.async_take(path, {"state": StateDict(state)})``: returns once every tensor is
  staged (``execute_write_reqs`` "returns as soon as all write requests are moved past the staging stage";
  CPU tensors are cloned because "during async snapshot, it's not safe to use tensor_as_memoryview() on the
  original CPU tensor"), so nothing is awaited before ``optimizer.step()``. The previous ``PendingSnapshot``
  is awaited (``.wait()``) before the next save. It needs a process group only for its commit barrier: without
  one it bootstraps a TCPStore and fails on an IPv4-only host (``create_store`` unpacks 4 values from an IPv4
  ``getsockname()``), so the adapter runs it in a gloo world of one. Files are not fsync'd.
* DLRover Flash Checkpoint ``DdpCheckpointer.save_checkpoint(step, state, path, StorageType.DISK)``: copies the
  state into shared memory synchronously inside the call, then an agent-side saver process ``torch.save``s it
  from shared memory. Nothing to wait for before the next step. Its saver skips a save (silently) while it still
  holds the shared-memory lock for the previous one, so the previous checkpoint is awaited before the next save:
  completion = the saver writing the step to ``dlrover_latest.txt`` (what ``wait_latest_checkpoint`` polls every
  3 s; the adapter polls every 5 ms). Under ``dlrover-run`` the saver is a thread of the elastic agent process
  (``AsyncCheckpointSaver.start_async_saving_ckpt()``); without it the engine would fork one from the training
  process (a copy-on-write twin of the model). The adapter stands in for the agent instead: it spawns a fresh
  process running the same ``start_async_saving_ckpt()`` and sets ``ROLE_NAME=dlrover-trainer`` as the agent
  does for its workers, plus a private ``TORCHELASTIC_RUN_ID`` (it names the shared memory and sockets).
  DLRover's saver skips step 0, so the adapter passes ``step + 1``. The data file is not fsync'd (the done
  and tracker files are).
* ByteCheckpoint ``bytecheckpoint.save(root, {"model", "optimizer", "extra_state"}, framework="ddp",
  fast_saving=True, global_steps=step, callback=...)``: clones every CPU tensor inside the call and writes (with
  fsync) on its I/O thread; the first save of a process is synchronous (metadata planning, plus starting its gRPC
  coordinator process). Nothing to wait for before the next step; ``callback`` fires once the tracker file is
  written (all files fsync'd), which is awaited before the next save. Needs ``torch.distributed`` (gloo world
  of one here). Declares torch<=2.5 (its own check is a string comparison that torch 2.13 passes); saving works
  unchanged on 2.13, loading needs ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (its loader calls ``torch.load``
  without ``weights_only``, and torch >= 2.6 defaults to True).
* fastckpt: ``Checkpointer.watch(optimizer)`` (lazy mode); its optimizer step pre-hook waits for staging.
  Nothing is awaited in the loop.

Every adapter also has ``load(step, template)``: the peer's own restore path, used once after the timed loop
to check that a checkpoint restores bit-exact (``measure.roundtrip``). ``template`` has the saved state's
structure with zeroed tensors (in-place loaders load into it).

Optional peers whose package is missing are skipped, not failed (``missing()`` says what to install)::

    pip install -e '.[bench-peers]'               # torchsnapshot-nightly==2024.7.26, dlrover==0.6.1 (torch untouched)
    pip install --no-deps bytecheckpoint==0.0.2   # its metadata pins torch<=2.5.0, grpcio==1.69.0, protobuf==3.20.3;
                                                  # the installed grpcio/protobuf work for local-disk DDP saves

DataStates-LLM is not measured: it is not on PyPI (``NOT_MEASURED``).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch


class Peer:
    name = "?"
    label = "?"
    requires: tuple[str, ...] = ()  # importable modules the peer needs
    install = ""  # how to install them

    @classmethod
    def missing(cls) -> str | None:
        """None when the peer can run here, else why not ("not installed: pip install ...")."""
        absent = [m for m in cls.requires if importlib.util.find_spec(m) is None]
        if absent:
            return f"not installed: {cls.install}"
        return None

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

    def load(self, step: int, template: dict) -> dict:
        """Restore checkpoint ``step`` (completed) with the peer's own loader; ``template`` is zeroed."""
        raise NotImplementedError


class _WorldOfOne:
    """A gloo process group of one rank (FileStore in a private temp dir) for libraries that need
    ``torch.distributed``; torn down on ``close()`` unless one was already initialized."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.tmp: str | None = None
        if not dist.is_initialized():
            self.tmp = tempfile.mkdtemp(prefix="fastckpt-bench-pg-")
            dist.init_process_group("gloo", init_method=f"file://{self.tmp}/store", rank=0, world_size=1)

    def close(self) -> None:
        if self.tmp is not None:
            if self.dist.is_initialized():
                self.dist.destroy_process_group()
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


class TorchSave(Peer):
    name = "torch_save"
    label = "torch.save"

    def save(self, state: dict, step: int) -> None:
        torch.save(state, self.root / f"step-{step:09d}.pt")

    def load(self, step: int, template: dict) -> dict:
        return torch.load(self.root / f"step-{step:09d}.pt", map_location="cpu", weights_only=True)


class LightningAsync(Peer):
    name = "lightning_async"
    label = "Lightning AsyncCheckpointIO"
    requires = ("lightning",)
    install = "pip install -e '.[bench]'"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, state: dict, step: int) -> None:
        self.io.save_checkpoint(state, str(self.root / f"step-{step:09d}.ckpt"))

    def flush(self) -> None:
        self.io.teardown()  # shuts the executor down after the queued writes; recreated on the next save

    def load(self, step: int, template: dict) -> dict:
        return self.io.load_checkpoint(str(self.root / f"step-{step:09d}.ckpt"), map_location="cpu")


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

    def load(self, step: int, template: dict) -> dict:
        self.dcp.load(template, checkpoint_id=str(self.root / f"step-{step:09d}"), no_dist=True)
        return template


class DcpStager(Peer):
    name = "dcp_stager"
    label = "DCP async_save + DefaultStager"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        import torch.distributed.checkpoint as dcp
        from .dcpstager import kept_stager

        self.dcp = dcp
        # CPU-only box: no pinned memory / non-blocking copies (they need an accelerator); no shared memory
        # (the uploader is a thread, not a process). Staging runs on the stager's own thread and reuses its
        # cached host storages from one checkpoint to the next.
        self.stager = kept_stager(use_pinned_memory=False, use_shared_memory=False, use_async_staging=True,
                                  use_non_blocking_copy=False)
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
        self.stager.release()

    def load(self, step: int, template: dict) -> dict:
        self.dcp.load(template, checkpoint_id=str(self.root / f"step-{step:09d}"), no_dist=True)
        return template


class Fastckpt(Peer):
    name = "fastckpt"
    label = "fastckpt"
    config: dict[str, Any] = {}  # the variants below change only this

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        from fastckpt import CheckpointConfig, Checkpointer

        self.ckpt = Checkpointer(CheckpointConfig(root=os.fspath(self.root), **self.config))
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

    def load(self, step: int, template: dict) -> dict:
        return self.ckpt.load(step)


class FastckptShm(Fastckpt):
    """The thread path staging in shared memory: the baseline the persister process is measured against."""

    name = "fastckpt-shm"
    label = "fastckpt (shm, threads)"
    config = {"staging": {"shm": True}}


class FastckptPersister(Fastckpt):
    """Staged in shared memory, written, fsynced and committed by the persister process (``persist.process``)."""

    name = "fastckpt-persister"
    label = "fastckpt (persister process)"
    config = {"staging": {"shm": True}, "persist": {"process": "on"}}


class FastckptTwoPass(Fastckpt):
    """The copy thread copies only; the I/O workers take the CRC32C and health statistics in a second pass over the
    staged bytes (``staging.crc_in_copy: false``, the default until 2026-11-30): the one pass's A/B reference."""

    name = "fastckpt-2pass"
    label = "fastckpt (two passes)"
    config = {"staging": {"crc_in_copy": False}}


class FastckptTorchPass(Fastckpt):
    """The batched torch pass instead of the compiled one (``staging.compiled_pass: off``): its A/B reference."""

    name = "fastckpt-torchpass"
    label = "fastckpt (torch pass)"
    config = {"staging": {"compiled_pass": "off"}}


class FastckptCompiled(Fastckpt):
    """``staging.compiled_pass: on``: the kernel warmed when the ``Checkpointer`` is made (``auto``, the default,
    warms it at the first save of 64 MiB or at ``prewarm()``; until then shards take the torch pass)."""

    name = "fastckpt-compiled"
    label = "fastckpt (compiled pass on)"
    config = {"staging": {"compiled_pass": "on"}}


class TorchSnapshot(Peer):
    name = "torchsnapshot"
    label = "torchsnapshot async_take"
    requires = ("torchsnapshot",)
    install = "pip install torchsnapshot-nightly==2024.7.26 (or pip install -e '.[bench-peers]')"

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        from torchsnapshot import Snapshot, StateDict

        self.Snapshot, self.StateDict = Snapshot, StateDict
        self.pg = _WorldOfOne()
        self.pending: Any = None

    def _path(self, step: int) -> str:
        return str(self.root / f"step-{step:09d}")

    def save(self, state: dict, step: int) -> None:
        self.flush()
        # Returns once everything is staged (CPU tensors cloned): safe to mutate right away.
        self.pending = self.Snapshot.async_take(self._path(step), {"state": self.StateDict(state)})

    def flush(self) -> None:
        if self.pending is not None:
            self.pending.wait()  # re-raises a failed background write
            self.pending = None

    def close(self) -> None:
        self.flush()
        self.pg.close()

    def load(self, step: int, template: dict) -> dict:
        target = self.StateDict(template)
        self.Snapshot(self._path(step)).restore({"state": target})
        return dict(target)


class DlroverFlash(Peer):
    name = "dlrover_flash"
    label = "DLRover Flash Checkpoint"
    requires = ("dlrover",)
    install = "pip install dlrover==0.6.1 (or pip install -e '.[bench-peers]')"
    timeout_s = 600.0

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        import logging
        import multiprocessing

        # The agent's environment for its workers: the saver lives outside the training process (ROLE_NAME),
        # shared memory and sockets are named after the run (a private id: no clash with other runs).
        self._env = {k: os.environ.get(k) for k in ("ROLE_NAME", "TORCHELASTIC_RUN_ID", "DLROVER_LOG_LEVEL")}
        self.run_id = f"fastckpt-bench-{os.getpid()}-{int(time.time() * 1e3) % 10**8}"
        os.environ.update(ROLE_NAME="dlrover-trainer", TORCHELASTIC_RUN_ID=self.run_id, DLROVER_LOG_LEVEL="WARNING")
        from dlrover.python.common.constants import CheckpointConstant
        from dlrover.trainer.torch.flash_checkpoint import engine as dl_engine
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        logging.getLogger("dlrover.logger").setLevel(logging.WARNING)
        # Stand-in for the elastic agent: a fresh (spawned, not forked) process running the agent's saver loop.
        self.saver = multiprocessing.get_context("spawn").Process(target=dl_engine.start_async_save, daemon=True,
                                                                  name="dlrover-agent-saver")
        self.saver.start()
        self.ckpt = DdpCheckpointer(os.fspath(self.root))  # waits for the saver's sockets
        self.StorageType = StorageType
        self.tracker = self.root / CheckpointConstant.TRACER_FILE_NAME
        self.pending: int | None = None

    def _path(self, step: int) -> str:
        return str(self.root / f"step-{step:09d}.pt")

    def save(self, state: dict, step: int) -> None:
        self.flush()
        dl_step = step + 1  # DLRover's saver ignores step 0 ("no checkpoint in memory")
        self.ckpt.save_checkpoint(dl_step, state, self._path(step), storage_type=self.StorageType.DISK)
        if self.ckpt._engine.latest_step != dl_step:
            raise RuntimeError(f"DLRover skipped the checkpoint of step {step} (shared memory busy)")
        self.pending = dl_step

    def flush(self) -> None:
        if self.pending is None:
            return
        t0 = time.monotonic()
        while True:
            try:
                if int(self.tracker.read_text().strip() or -1) == self.pending:
                    break
            except (FileNotFoundError, ValueError):
                pass
            if not self.saver.is_alive():
                raise RuntimeError(f"DLRover's saver process died (exit code {self.saver.exitcode})")
            if time.monotonic() - t0 > self.timeout_s:
                raise TimeoutError(f"DLRover did not commit step {self.pending - 1} in {self.timeout_s:.0f}s")
            time.sleep(0.005)
        self.pending = None

    def close(self) -> None:
        try:
            self.flush()
        finally:
            eng = self.ckpt._engine
            try:
                eng._shm_handler.unlink()  # the shared-memory buffer (created by this process) + its metadata
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass
            eng.close()
            self.saver.terminate()
            self.saver.join(10)
            from dlrover.python.common.multi_process import SOCKET_TMP_DIR

            shutil.rmtree(os.path.join(SOCKET_TMP_DIR, self.run_id), ignore_errors=True)
            for k, v in self._env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def load(self, step: int, template: dict) -> dict:
        # DdpCheckpointer.load_checkpoint() prefers the copy in shared memory; this reads the file the saver
        # wrote, as its storage path does (engine._load_from_storage: torch.load(path, map_location="cpu")).
        return torch.load(self._path(step), map_location="cpu", weights_only=True)


class _Held:
    """A ready state dict behind the ``state_dict()``/``load_state_dict()`` interface ByteCheckpoint expects."""

    def __init__(self, sd: dict) -> None:
        self.sd = sd

    def state_dict(self) -> dict:
        return self.sd

    def load_state_dict(self, sd: dict) -> None:
        self.sd = sd


class ByteCheckpoint(Peer):
    name = "bytecheckpoint"
    label = "ByteCheckpoint (fast_saving)"
    requires = ("bytecheckpoint",)
    install = ("pip install --no-deps bytecheckpoint==0.0.2 (--no-deps: its metadata pins torch<=2.5.0, "
               "grpcio==1.69.0, protobuf==3.20.3)")
    timeout_s = 600.0

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        import logging

        os.environ.setdefault("BYTECHECKPOINT_LOGGING_LEVEL", "WARNING")
        import bytecheckpoint

        logging.getLogger("bytecheckpoint").setLevel(logging.WARNING)
        self.bcp = bytecheckpoint
        self.pg = _WorldOfOne()
        self.done: threading.Event | None = None
        self.pending_step: int | None = None

    @staticmethod
    def _split(state: dict) -> dict:
        extra = {k: v for k, v in state.items() if k not in ("model", "optim")}
        return {"model": _Held(state["model"]), "optimizer": _Held(state["optim"]), "extra_state": extra}

    def save(self, state: dict, step: int) -> None:
        self.flush()
        self.done = threading.Event()
        self.pending_step = step
        self.bcp.save(os.fspath(self.root), self._split(state), framework="ddp", fast_saving=True,
                      global_steps=step, callback=self.done.set)

    def flush(self) -> None:
        if self.done is None:
            return
        if not self.done.wait(self.timeout_s):
            raise TimeoutError(f"ByteCheckpoint did not commit step {self.pending_step} in {self.timeout_s:.0f}s "
                               "(a failed background write is only logged)")
        self.done = None

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.pg.close()

    def load(self, step: int, template: dict) -> dict:
        target = self._split(template)
        prev = os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"  # its torch.load calls predate torch 2.6
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD detected"
                self.bcp.load(os.fspath(self.root / f"global_step_{step}"), target, framework="ddp")
        finally:
            if prev is None:
                os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
            else:
                os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = prev
        return {"model": target["model"].sd, "optim": target["optimizer"].sd, **target["extra_state"]}


PEERS: dict[str, type[Peer]] = {p.name: p for p in (TorchSave, LightningAsync, DcpDefault, DcpStager, TorchSnapshot,
                                                    DlroverFlash, ByteCheckpoint, Fastckpt, FastckptShm,
                                                    FastckptPersister, FastckptTwoPass, FastckptTorchPass,
                                                    FastckptCompiled)}
# fastckpt's variants, compared in turns by ``python -m benchmarks.persister --peers ...``, run in the harness only when
# named: ``python -m benchmarks.run --peers ...,fastckpt-shm,fastckpt-persister`` (more full runs per section otherwise).
VARIANTS = ("fastckpt-shm", "fastckpt-persister", "fastckpt-2pass", "fastckpt-torchpass", "fastckpt-compiled")
ORDER = [name for name in PEERS if name not in VARIANTS]
LABELS = {name: cls.label for name, cls in PEERS.items()}
# Peers fastckpt is judged against that this suite cannot run, and why.
NOT_MEASURED = {
    "DataStates-LLM": "not on PyPI: it is built from its GitHub source (github.com/DataStates/datastates-llm, a "
                      "C++/pybind11 extension used through DeepSpeed), which a package-registry-only install "
                      "cannot fetch",
}


def make(name: str, root: Path) -> Peer:
    return PEERS[name](root)
