"""The files stock ``Accelerator.save_state`` writes, as data for ``Checkpointer.save_files``.

Mirrors ``accelerate.checkpointing.save_accelerator_state`` and ``save_custom_state`` (Accelerate 1.15) for
single-process and DDP training: the same file names, and for each file the object stock passes to
``safetensors.torch.save_file`` or ``torch.save``. The engine then writes each file in that format, so stock
``load_state`` (with or without fastckpt) reads the folder. The dicts hold live aliases of parameters and
optimizer state: the engine copies them before the next watched ``optimizer.step()``.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.data_loader import IterableDatasetShard, SeedableRandomSampler
from accelerate.utils import (OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_WEIGHTS_NAME, SAMPLER_NAME,
                              SCALER_NAME, SCHEDULER_NAME, WEIGHTS_NAME, is_cuda_available, is_xpu_available)
from accelerate.utils.other import clean_state_dict_for_safetensors

from fastckpt.format.bundle import SAFETENSORS, TORCH

__all__ = ["rng_file_state", "stock_files"]

Files = dict[str, tuple[str, Any]]


def rng_file_state(step: int) -> dict[str, Any]:
    """What stock writes to ``random_states_{rank}.pkl`` on this process (CPU, CUDA and XPU generators)."""
    states: dict[str, Any] = {
        "step": step,
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if is_xpu_available():
        states["torch_xpu_manual_seed"] = torch.xpu.get_rng_state_all()
    if is_cuda_available():
        states["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return states


def stock_files(accelerator: Accelerator, output_dir: str, safe_serialization: bool,
                rng_states: list[dict[str, Any]]) -> Files:
    """Every file of ``save_state(output_dir)``; ``rng_states``: each process's ``rng_file_state``, by rank."""
    files: Files = {}
    weights = [accelerator.get_state_dict(model, unwrap=False) for model in accelerator._models]
    for hook in accelerator._save_model_state_pre_hook.values():  # may edit ``weights``, as with stock
        hook(accelerator._models, weights, output_dir)
    for i, state in enumerate(weights):
        name = _indexed(SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME, i)
        if safe_serialization and isinstance(state, OrderedDict):
            state = clean_state_dict_for_safetensors(state)  # tied weights: stock keeps the first name only
        files[name] = (SAFETENSORS if safe_serialization else TORCH, state)
    for i, opt in enumerate(accelerator._optimizers):
        files[f"{OPTIMIZER_NAME}.bin" if i == 0 else f"{OPTIMIZER_NAME}_{i}.bin"] = (TORCH, opt.state_dict())
    for i, scheduler in enumerate(accelerator._schedulers):
        files[f"{SCHEDULER_NAME}.bin" if i == 0 else f"{SCHEDULER_NAME}_{i}.bin"] = (TORCH, scheduler.state_dict())
    for i, dataloader in enumerate(accelerator._dataloaders):
        files.update(_dataloader_files(dataloader, i))
    if accelerator.scaler is not None:
        files[SCALER_NAME] = (TORCH, accelerator.scaler.state_dict())
    for rank, states in enumerate(rng_states):
        files[f"{RNG_STATE_NAME}_{rank}.pkl"] = (TORCH, states)
    for i, obj in enumerate(accelerator._custom_objects):
        files[f"custom_checkpoint_{i}.pkl"] = (TORCH, obj.state_dict())
    return files


def _dataloader_files(dataloader: Any, i: int) -> Files:
    """The sampler (only Accelerate's seedable one over an iterable shard) and a stateful loader's state."""
    files: Files = {}
    if isinstance(dataloader.dataset, IterableDatasetShard):
        sampler = dataloader.get_sampler()
        if isinstance(sampler, SeedableRandomSampler):
            files[f"{SAMPLER_NAME}.bin" if i == 0 else f"{SAMPLER_NAME}_{i}.bin"] = (TORCH, sampler)
    if getattr(dataloader, "use_stateful_dataloader", False):
        files["dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"] = (TORCH, dataloader.state_dict())
    return files


def _indexed(name: str, i: int) -> str:
    """``model.safetensors`` -> ``model_1.safetensors`` (stock's ``replace(".", f"_{i}.")``)."""
    return name if i == 0 else name.replace(".", f"_{i}.")
