"""Framework measures: Lightning ``Trainer.fit`` (issue #3) and an Accelerate loop (issue #4).

Each config runs in its own process. As in the plain loop, one checkpoint is taken (and finished) during
the untimed warm-up, for every config alike: it pays each peer's one-off costs (plan, allocation and first
touch of host buffers) and is reported on its own as ``first_save_block_s``. The timed region then starts
and ends when the training loop ends (Lightning: ``on_train_end``; Accelerate: after the last step), so the
final flush (Lightning's ``teardown`` of the checkpoint IO, Accelerate's ``end_training``) is timed separately.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import workload as wl
from .measure import RssSampler, med, now, rmtree, rss, tree_bytes

LIGHTNING_CONFIGS = ["baseline", "torch_io", "async_io", "fastckpt"]
LIGHTNING_LABELS = {
    "baseline": "no checkpointing",
    "torch_io": "TorchCheckpointIO (default)",
    "async_io": "AsyncCheckpointIO(TorchCheckpointIO())",
    "fastckpt": "fastckpt_lightning.FastCheckpointIO",
}
ACCELERATE_CONFIGS = ["baseline", "stock", "fastckpt"]
ACCELERATE_LABELS = {
    "baseline": "no checkpointing",
    "stock": "Accelerator.save_state (stock)",
    "fastckpt": "fastckpt_accelerate.enable",
}


def _n_steps(warmup: int, every: int, n_ckpt: int) -> int:
    # checkpoints at global steps every (warm-up), 2*every, ... (n_ckpt+1)*every; every//2 more after the last
    return (n_ckpt + 1) * every + every // 2


def _warmup(warmup: int, every: int) -> int:
    # the warm-up covers the first checkpoint (global step ``every``) and the step after it
    return max(warmup, every + 2)


# ---------------------------------------------------------------------------------------------- Lightning


def task_lightning(config: str, shape: dict, root: str, warmup: int, every: int, n_ckpt: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    wl.setup_threads()
    wl.tune_malloc()
    s = wl.Shape(**shape)
    root_p = Path(root)
    rmtree(root_p)
    root_p.mkdir(parents=True)
    max_steps = _n_steps(warmup, every, n_ckpt)
    warmup = _warmup(warmup, every)
    if max_steps <= warmup:
        raise ValueError("warmup must be shorter than the run")

    class LitGPT(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = wl.GPTish(s)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return wl.loss_fn(self.model, x, y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return wl.make_optimizer(self.parameters())

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, s.vocab, ((max_steps + 8) * s.batch, s.seq + 1), generator=g)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=s.batch, shuffle=False)

    class Clock(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.end = 0.0
            self.rss_before: int | None = None
            self.sampler: RssSampler | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if len(self.starts) == warmup:
                _drain(trainer.strategy.checkpoint_io)  # the warm-up checkpoint ends before timing starts
                self.rss_before = rss()
                self.sampler = RssSampler().start()
            self.starts.append(now())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.end = now()

    class TimedCheckpoint(ModelCheckpoint):
        blocks: list[float] = []

        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            t0 = now()
            super()._save_checkpoint(trainer, filepath)
            self.blocks.append(now() - t0)

    clock = Clock()
    callbacks: list[Any] = [clock]
    plugins: list[Any] = []
    mc = None
    if config != "baseline":
        mc = TimedCheckpoint(dirpath=str(root_p / "ckpts"), every_n_train_steps=every, save_top_k=-1)
        mc.blocks = []
        callbacks.append(mc)
    if config == "async_io":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        plugins.append(AsyncCheckpointIO(TorchCheckpointIO()))
    elif config == "fastckpt":
        import fastckpt_lightning

        plugins.append(fastckpt_lightning.FastCheckpointIO(root=str(root_p / "fastckpt")))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        enable_checkpointing=config != "baseline", callbacks=callbacks, plugins=plugins or None,
        default_root_dir=str(root_p),
    )
    t_fit = now()
    trainer.fit(LitGPT(), data)
    t_done = now()
    peak = clock.sampler.stop() if clock.sampler else None
    starts = clock.starts
    n = len(starts) - warmup
    steps = [b - a for a, b in zip(starts[warmup:], starts[warmup + 1:])] + [clock.end - starts[-1]]
    timed = mc.blocks[1:] if mc else []  # blocks[0]: the warm-up checkpoint
    out = {
        "config": config,
        "max_steps": max_steps,
        "n_steps": n,
        "n_ckpt": len(timed),
        "first_save_block_s": mc.blocks[0] if mc and mc.blocks else None,
        "save_block_s": timed,
        "save_block_median_s": med(timed) if timed else None,
        "loop_s": clock.end - starts[warmup],
        "steps_s": steps,
        "flush_s": t_done - clock.end,
        "fit_s": t_done - t_fit,
        "rss_before_saves": clock.rss_before,
        "peak_rss": peak,
        "bytes_on_disk": tree_bytes(root_p),
    }
    rmtree(root_p)
    return out


def _drain(io: Any) -> None:
    """Wait until a checkpoint IO has no background work left (untimed)."""
    if hasattr(io, "flush"):  # fastckpt_lightning.FastCheckpointIO
        io.flush()
    executor = getattr(io, "_executor", None)  # AsyncCheckpointIO: one FIFO worker
    if executor is not None:
        executor.submit(lambda: None).result()


# ---------------------------------------------------------------------------------------------- Accelerate


def task_accelerate(config: str, shape: dict, root: str, warmup: int, every: int, n_ckpt: int) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    wl.setup_threads()
    wl.tune_malloc()
    s = wl.Shape(**shape)
    root_p = Path(root)
    rmtree(root_p)
    root_p.mkdir(parents=True)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(root_p), automatic_checkpoint_naming=True))
    fast = None
    if config == "fastckpt":
        import fastckpt_accelerate
        from fastckpt import CheckpointConfig

        fast = fastckpt_accelerate.enable(accelerator, CheckpointConfig(root=str(root_p / "fastckpt")))
    model, opt = wl.build(s)
    model, opt = accelerator.prepare(model, opt)
    batches = wl.Batches(s)

    def step() -> None:
        x, y = batches.next()
        loss = wl.loss_fn(model, x, y)
        opt.zero_grad(set_to_none=False)
        accelerator.backward(loss)
        opt.step()

    for _ in range(warmup):
        step()
    first_block = None
    if config != "baseline":  # the untimed warm-up checkpoint, finished before timing starts
        tb = now()
        accelerator.save_state()
        first_block = now() - tb
        if fast is not None:
            fast.wait()
        step()
    n = _n_steps(0, every, n_ckpt) - every
    rss_before = rss()
    sampler = RssSampler().start()
    blocks: list[float] = []
    steps: list[float] = []
    t0 = now()
    for i in range(1, n + 1):
        ts = now()
        step()
        if config != "baseline" and i % every == 0:
            tb = now()
            accelerator.save_state()
            blocks.append(now() - tb)
        steps.append(now() - ts)
    loop_s = now() - t0
    tf = now()
    accelerator.end_training()
    flush_s = now() - tf
    peak = sampler.stop()
    out = {
        "config": config,
        "n_steps": n,
        "n_ckpt": len(blocks),
        "first_save_block_s": first_block,
        "save_block_s": blocks,
        "save_block_median_s": med(blocks),
        "loop_s": loop_s,
        "steps_s": steps,
        "flush_s": flush_s,
        "rss_before_saves": rss_before,
        "peak_rss": peak,
        "bytes_on_disk": tree_bytes(root_p),
    }
    rmtree(root_p)
    return out
