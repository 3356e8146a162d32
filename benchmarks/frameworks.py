"""Framework measures: Lightning ``Trainer.fit`` (issue #3) and an Accelerate loop (issue #4).

Each config runs in its own process. As in the plain loop, one checkpoint is taken (and finished) during
the untimed warm-up, for every config alike: it pays each peer's one-off costs (plan, allocation and first
touch of host buffers) and is reported on its own as ``first_save_block_s``.

The stall is measured as in the plain loop, inside one run: the timed steps are cut in windows of K steps,
clean, checkpointed, clean, ..., checkpointed, clean. A checkpointed window holds the checkpoint call right
after its first step (Lightning: ``ModelCheckpoint`` in ``on_train_batch_end``; Accelerate: ``save_state()``),
its K steps, and the config's flush at its end (what the next checkpoint would otherwise wait for: the
AsyncCheckpointIO worker, fastckpt's ``wait()``); each is compared with the mean of its two clean neighbours
(``measure.paired_stall``). A separate no-checkpoint run per section (``baseline``) gives the RSS reference
only: comparing whole runs mixed the step-time drift between processes (two baseline runs 4.6% apart over
64 steps, about 0.2 s per checkpoint) into the stall. The run ends with the last clean window (Lightning:
``on_train_end``); the final flush (Lightning's ``teardown`` of the checkpoint IO, Accelerate's
``end_training``) is timed separately.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import workload as wl
from .measure import RssSampler, drop_cache, med, now, paired_stall, rmtree, rss, tree_bytes

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


def _warmup(warmup: int, every: int) -> int:
    # the warm-up covers the first checkpoint (global step ``every``) and the step after it
    return max(warmup, every + 2)


def _windowed(windows: list[float], every: int) -> dict[str, Any]:
    """The paired stall of windows clean, ckpt, clean, ..., clean (``every`` steps each)."""
    out = paired_stall(windows[1::2], windows[0::2])
    out.update(windows_s=windows, window_steps=every, loop_s=sum(windows), n_steps=len(windows) * every)
    return out


# ---------------------------------------------------------------------------------------------- Lightning


def task_lightning(config: str, shape: dict, root: str, warmup: int, every: int, n_ckpt: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    wl.setup_threads()
    wl.tune_malloc()
    s = wl.Shape(**shape)
    root_p = Path(root)
    rmtree(root_p)
    root_p.mkdir(parents=True)
    warmup = _warmup(warmup, every)
    n_windows = 2 * n_ckpt + 1
    max_steps = warmup + n_windows * every
    # batch b (from 0) ends at global step b + 1; checkpointed window m (odd) saves after its first batch
    save_steps = {every} | {warmup + m * every + 1 for m in range(1, n_windows, 2)}

    LitGPT = _lit_gpt_class(s)
    data = _token_batches(s, max_steps + 8)

    class Clock(Callback):
        def __init__(self) -> None:
            self.bounds: list[float] = []  # start of each window (after the flush that ends a checkpointed one)
            self.starts: list[float] = []  # start of each timed step
            self.end = 0.0
            self.rss_before: int | None = None
            self.sampler: RssSampler | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            b = trainer.global_step
            if b == warmup:
                _drain(trainer.strategy.checkpoint_io)  # the warm-up checkpoint ends before timing starts
                self.rss_before = rss()
                self.sampler = RssSampler().start()
            if b >= warmup and (b - warmup) % every == 0:
                if ((b - warmup) // every) % 2 == 0 and b > warmup:  # a checkpointed window ends: its flush
                    _drain(trainer.strategy.checkpoint_io)
                self.bounds.append(now())
            if b >= warmup:
                self.starts.append(now())

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self.end = now()

    class WindowedCheckpoint(ModelCheckpoint):
        """ModelCheckpoint, saving only at the windows' global steps (``every_n_train_steps=1`` gated)."""

        blocks: list[float] = []

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            if trainer.global_step in save_steps:
                super().on_train_batch_end(trainer, *args, **kwargs)

        def _save_checkpoint(self, trainer: Any, filepath: str) -> None:
            t0 = now()
            super()._save_checkpoint(trainer, filepath)
            self.blocks.append(now() - t0)

    clock = Clock()
    callbacks: list[Any] = [clock]
    plugins: list[Any] = []
    mc = None
    if config != "baseline":
        mc = WindowedCheckpoint(dirpath=str(root_p / "ckpts"), every_n_train_steps=1, save_top_k=-1)
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
    bounds = clock.bounds + [clock.end]
    if len(bounds) != n_windows + 1:
        raise RuntimeError(f"expected {n_windows} windows, timed {len(bounds) - 1}")
    starts = clock.starts + [clock.end]
    timed = mc.blocks[1:] if mc else []  # blocks[0]: the warm-up checkpoint
    if mc is not None and len(timed) != n_ckpt:
        raise RuntimeError(f"expected {n_ckpt} timed checkpoints, took {len(timed)}")
    out = {
        "config": config,
        "max_steps": max_steps,
        "n_ckpt": len(timed),
        "first_save_block_s": mc.blocks[0] if mc and mc.blocks else None,
        "save_block_s": timed,
        "save_block_median_s": med(timed) if timed else None,
        "steps_s": [b - a for a, b in zip(starts, starts[1:])],
        "flush_s": t_done - clock.end,
        "fit_s": t_done - t_fit,
        "rss_before_saves": clock.rss_before,
        "peak_rss": peak,
        "bytes_on_disk": tree_bytes(root_p),
        **_windowed([b - a for a, b in zip(bounds, bounds[1:])], every),
    }
    rmtree(root_p)
    return out


def _lit_gpt_class(s: wl.Shape) -> Any:
    """The benchmark model as a LightningModule (a class per shape: ``load_from_checkpoint`` builds one)."""
    import lightning.pytorch as pl

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

    return LitGPT


def _token_batches(s: wl.Shape, n_batches: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, s.vocab, (n_batches * s.batch, s.seq + 1), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=s.batch, shuffle=False)


def task_lightning_load(shape: dict, root: str, reps: int, cold: bool) -> dict[str, Any]:
    """``load_from_checkpoint`` (and ``torch.load``) of one trained state saved twice by ``Trainer.save_checkpoint``:
    by FastCheckpointIO and by the stock TorchCheckpointIO (``torch.save``). Interleaved, warm page cache (both warmed
    by the same reads); then cold (fadvise DONTNEED) once each."""
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    import fastckpt_lightning

    wl.setup_threads()
    s = wl.Shape(**shape)
    root_p = Path(root)
    rmtree(root_p)
    root_p.mkdir(parents=True)
    LitGPT = _lit_gpt_class(s)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         plugins=[fastckpt_lightning.FastCheckpointIO()], default_root_dir=str(root_p))
    trainer.fit(LitGPT(), _token_batches(s, 4))  # two steps: AdamW's state exists
    paths = {"fastckpt": root_p / "fastckpt.ckpt", "torch_save": root_p / "torch_save.ckpt"}
    trainer.save_checkpoint(paths["fastckpt"])  # after fit: finished (durable) when it returns
    trainer.strategy.checkpoint_io = TorchCheckpointIO()
    trainer.save_checkpoint(paths["torch_save"])
    del trainer

    def load_module(path: Path) -> float:
        t0 = now()
        module = LitGPT.load_from_checkpoint(path, map_location="cpu")
        dt = now() - t0
        del module
        return dt

    def load_dict(path: Path) -> float:
        t0 = now()
        state = torch.load(path, map_location="cpu", weights_only=True)
        dt = now() - t0
        del state
        return dt

    out: dict[str, Any] = {"ckpt_bytes": {k: p.stat().st_size for k, p in paths.items()}}
    # Both files leave the page cache before the warm-up round, so both are cached the same way, by that round's
    # reads: torch.save's pages were left there by its buffered writes (other folios than readahead makes), while
    # fastckpt writes past the cache (O_DIRECT), so it alone would be warmed by reading.
    for path in paths.values():
        drop_cache(path)
    for name, load in (("load_from_checkpoint", load_module), ("torch_load", load_dict)):
        times: dict[str, list[float]] = {k: [] for k in paths}
        for r in range(reps + 1):  # the first round warms the page cache and the allocator: not kept
            for key in (list(paths) if r % 2 == 0 else list(reversed(paths))):
                dt = load(paths[key])
                if r > 0:
                    times[key].append(dt)
        out[name] = {"warm_s": times, "warm_ratio": med(times["fastckpt"]) / med(times["torch_save"])}
        if cold:
            cold_s = {}
            for key, path in paths.items():
                drop_cache(path)
                cold_s[key] = load(path)
            out[name]["cold_s"] = cold_s
            out[name]["cold_ratio"] = cold_s["fastckpt"] / cold_s["torch_save"]
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
    rss_before = rss()
    sampler = RssSampler().start()
    blocks: list[float] = []
    steps: list[float] = []
    windows: list[float] = []
    for m in range(2 * n_ckpt + 1):  # clean, checkpointed, clean, ..., clean
        tw = now()
        for k in range(every):
            ts = now()
            step()
            if m % 2 and k == 0 and config != "baseline":
                tb = now()
                accelerator.save_state()
                blocks.append(now() - tb)
            if m % 2 and k == every - 1 and fast is not None:
                fast.wait()  # the checkpointed window's flush: what the next save_state() would wait for
            steps.append(now() - ts)
        windows.append(now() - tw)
    tf = now()
    accelerator.end_training()
    flush_s = now() - tf
    peak = sampler.stop()
    out = {
        "config": config,
        "n_ckpt": len(blocks),
        "first_save_block_s": first_block,
        "save_block_s": blocks,
        "save_block_median_s": med(blocks),
        "steps_s": steps,
        "flush_s": flush_s,
        "rss_before_saves": rss_before,
        "peak_rss": peak,
        "bytes_on_disk": tree_bytes(root_p),
        **_windowed(windows, every),
    }
    rmtree(root_p)
    return out
