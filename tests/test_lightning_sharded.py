"""Lightning ModelParallelStrategy (FSDP2 on CPU, gloo) through FastModelParallelStrategy: 4 ranks save, 2 resume
from "last", 1 resumes from an explicit path; every resume bit-exact; no rank holds the full state while saving.

Lightning's launcher starts the other ranks by re-running the command line, so each phase runs this file as a
script (as ``test_lightning_ddp.py`` does).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
WIDTH, LAYERS = 1024, 8  # 8.4M parameters: 33.6 MB of weights, 101 MB with AdamW's two moments

pytestmark = pytest.mark.slow


def _run_phase(root: Path, phase: str, devices: int, max_steps: int, ckpt_path: str, ok: bool = True) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    args = [sys.executable, __file__, str(root), phase, str(devices), str(max_steps), ckpt_path]
    from rank_logs import run_phase

    code, err, report = run_phase(args, env, root / f"{phase}-logs", 500)
    assert (code == 0) == ok, f"{phase} exited {code}:\n{report}"
    return err


def test_model_parallel_saves_sharded_and_resumes_on_other_world_sizes(tmp_path) -> None:
    from helpers import assert_bit_equal

    _run_phase(tmp_path, "train4", 4, 3, "none")
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "last.ckpt" / "manifest.json").is_file(), "a sharded checkpoint is a folder"
    names = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("."))  # .fastckpt.lock: the root's lock
    assert names == ["epoch=0-step=3.ckpt", "last.ckpt"], "top-k removed the older folders"
    manifest = json.loads((ckpt / "last.ckpt" / "manifest.json").read_text())
    meta = json.loads((ckpt / "last.ckpt" / manifest["meta"]).read_text())
    weight = next(d for d in meta["dtensors"] if d["key"] == "state_dict/net.0.weight")
    assert weight["offsets"] == [[0, 0], [256, 0], [512, 0], [768, 0]], "each rank wrote its own block"

    # resume2's launch goes on with validate2 (a fresh Trainer, plugin and module, in the same 2 ranks: see the
    # script); its plugin opens the root the fit's plugin saved to, so the fit must have released it at teardown
    _run_phase(tmp_path, "resume2", 2, 5, "last")
    assert_bit_equal(_load(tmp_path, "train4-end"), _load(tmp_path, "resume2-start"))

    _run_phase(tmp_path, "resume1", 1, 6, str(ckpt / "epoch=0-step=5.ckpt"))
    assert_bit_equal(_load(tmp_path, "resume2-end"), _load(tmp_path, "resume1-start"))

    # validate(ckpt_path=<sharded folder>) loads the folder's weights into the model
    validated = torch.load(tmp_path / "validate2-start.pt", weights_only=True)
    assert_bit_equal(_load(tmp_path, "resume2-end")["model"], validated["model"])

    full = sum(t.numel() * t.element_size() for t in _tensors(_load(tmp_path, "train4-end")))
    for rank in range(4):
        growth = int((tmp_path / f"train4-rss-{rank}.txt").read_text())
        print(f"rank {rank}: peak RSS grew {growth / 2**20:.1f} MiB while saving; full state {full / 2**20:.1f} MiB")
        assert growth < full / 2, f"rank {rank} grew {growth} bytes while saving a {full}-byte state (1/4 is its own)"


def test_a_rank_failing_to_write_fails_that_checkpoint_everywhere(tmp_path) -> None:
    """Rank 1's disk fills during the second save: training stops with the error, that folder is never committed,
    and the first one stays whole."""
    from fastckpt import consolidate, is_checkpoint

    err = _run_phase(tmp_path, "fail2", 2, 4, "none", ok=False)
    # the whole of rank 0's stderr on a failure (pytest elides the middle of a long string: a run beside two
    # CPU-bound burners once exited without this message, and the elided part was the only evidence of why)
    assert "injected: ENOSPC" in err and "epoch=0-step=2.ckpt" in err, f"rank 0's stderr:\n{err}"
    ckpt = tmp_path / "ckpt"
    assert not is_checkpoint(str(ckpt / "epoch=0-step=2.ckpt"))
    assert consolidate(str(ckpt / "epoch=0-step=1.ckpt"))["global_step"] == 1


def _load(root: Path, name: str) -> dict[str, Any]:
    state = torch.load(root / f"{name}.pt", weights_only=True)
    assert state.pop("global_step") == {"train4-end": 3, "resume2-start": 3, "resume2-end": 5,
                                        "resume1-start": 5}[name]
    return state


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


# ---- the script (every rank) -------------------------------------------------------------------------------------


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _main(root: Path, phase: str, devices: int, max_steps: int, ckpt_path: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.utils.data import DataLoader, TensorDataset

    from fastckpt_lightning import FastCheckpointIO, FastModelParallelStrategy

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def full_state(trainer: pl.Trainer, module: Net) -> dict[str, Any]:
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)  # collective: every rank calls it
        optimizer = trainer.optimizers[0]
        return {"model": get_model_state_dict(module.net, options=options),
                "optim": get_optimizer_state_dict(module.net, optimizer, options=options)["state"],
                "global_step": trainer.global_step}

    class Capture(Callback):
        def on_train_start(self, trainer: pl.Trainer, module: Net) -> None:
            if phase != "train4":
                self._dump(trainer, module, f"{phase}-start")

        def on_train_end(self, trainer: pl.Trainer, module: Net) -> None:
            self._dump(trainer, module, f"{phase}-end")

        def on_validation_start(self, trainer: pl.Trainer, module: Net) -> None:
            if phase.startswith("validate"):  # no optimizer here: the weights the sharded folder gave the model
                model = get_model_state_dict(module.net, options=StateDictOptions(full_state_dict=True))
                if trainer.is_global_zero:
                    torch.save({"model": model}, root / f"{phase}-start.pt")

        def _dump(self, trainer: pl.Trainer, module: Net, name: str) -> None:
            state = full_state(trainer, module)
            if trainer.is_global_zero:
                torch.save(state, root / f"{name}.pt")

    class Probed(FastModelParallelStrategy):
        """Measures the peak RSS of the first save, from the state dicts to the end of the lazy copies."""

        probing = True

        def lightning_module_state_dict(self) -> dict[str, Any]:
            if self.probing:
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (the peak) to the current RSS
                self.rss0 = _rss("VmRSS")
            return super().lightning_module_state_dict()

        def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
            if self.probing:  # the core gets the live blocks (copied lazily), not an offloaded copy of them
                from torch.distributed.tensor import DTensor

                optimizer = getattr(self.optimizers[0], "_optimizer", self.optimizers[0])
                live = [p.to_local() for p in self.model.parameters()]
                live += [v.to_local() for st in optimizer.state.values() for v in st.values() if isinstance(v, DTensor)]
                handed = [t for t in _tensors(checkpoint) if isinstance(t, DTensor)]
                assert len(handed) == len(live) == 3 * 2 * LAYERS, (len(handed), len(live))
                assert {t.to_local().data_ptr() for t in handed} == {t.data_ptr() for t in live}
            super().save_checkpoint(checkpoint, filepath, storage_options)
            if self.probing:
                self.probing = False
                self.fast_io.wait_staged()
                growth = _rss("VmHWM") - self.rss0
                (root / f"{phase}-rss-{self.global_rank}.txt").write_text(str(growth))

    class FullDisk(FastCheckpointIO):
        """Rank 1's writes into the second checkpoint fail, as on a full disk."""

        def _create_distributed_checkpointer(self, config: Any) -> Any:
            import errno

            import torch.distributed as dist
            from fastckpt import Checkpointer, open_storage
            from helpers import WrappedStorage

            class Full(WrappedStorage):
                def write_file(self, path: str, parts: Any) -> None:
                    if "step=2.ckpt" in path:
                        raise OSError(errno.ENOSPC, "injected: ENOSPC", path)
                    self.inner.write_file(path, parts)

            storage = open_storage(config.root)
            return Checkpointer(config, storage=Full(storage) if dist.get_rank() == 1 else storage, distributed=True)

    io_class = FullDisk if phase == "fail2" else FastCheckpointIO
    plugin = io_class(persist={"fsync": False, "chunk_bytes": 4 << 20})
    strategy = Probed(data_parallel_size=devices, tensor_parallel_size=1)
    keep = -1 if phase == "fail2" else 1
    checkpoints = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=keep, save_last=keep == 1)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, plugins=[plugin],
                         callbacks=[checkpoints, Capture()], max_steps=max_steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    gen = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randn(64, WIDTH, generator=gen)), batch_size=4)
    if phase.startswith("validate"):
        trainer.validate(Net(), data, ckpt_path=ckpt_path)
    else:
        trainer.fit(Net(), data, ckpt_path=None if ckpt_path == "none" else ckpt_path)
    # Lightning has no barrier after on_train_end: the ranks done with the last full-state gather exited while a
    # slower rank 0 (a loaded machine) was still in it, and an exiting gloo peer closes its sockets (a reset when
    # bytes are unread). Leave together, as tests/dist_launcher.py does.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


if __name__ == "__main__":
    from rank_logs import split_rank_output

    split_rank_output()
    root = Path(sys.argv[1])
    _main(root, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    if sys.argv[2] == "resume2":
        # validate2 in the same ranks (their imports cost more than a validation): a fresh Trainer, strategy, plugin
        # and module (seed 0: not the trained weights), so the weights it checks come from the folder resume2 saved
        # last. Lightning reuses the initialized process group and launches no ranks again (rank 0's launcher set
        # LOCAL_RANK).
        _main(root, "validate2", int(sys.argv[3]), 0, str(root / "ckpt" / "epoch=0-step=5.ckpt"))


def test_removing_a_sharded_folder_this_process_never_saved_to(tmp_path) -> None:
    """Rank 0 alone removes (ModelCheckpoint's top-k); with no Checkpointer of the folder yet it must not build the
    collective one (the other ranks are not there), and still delete the folder, manifest first."""
    from fastckpt import CheckpointConfig, Checkpointer, is_checkpoint
    from fastckpt_lightning import FastCheckpointIO

    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save({"w": torch.ones(3)}, step=4, name="epoch=0-step=4.ckpt").wait()
        ckpt.save({"w": torch.zeros(3)}, step=5, name="last.ckpt").wait()
    path = tmp_path / "epoch=0-step=4.ckpt"
    assert is_checkpoint(str(path))
    FastCheckpointIO().remove_sharded(str(path))  # no torch.distributed here: a collective would raise
    assert not path.exists() and is_checkpoint(str(tmp_path / "last.ckpt"))
