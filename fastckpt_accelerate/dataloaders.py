"""Dataloader position: epoch counter, seedable sampler, shuffling generator, and torchdata stateful state.

Accelerate saves a sampler only for ``IterableDatasetShard`` datasets (by pickling the sampler object) and
never saves the epoch counter (``DataLoaderShard.iteration``), so a resumed run reshuffles epoch 0 again.
We save plain values instead, which also keeps the checkpoint free of pickled classes.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.data_loader import SeedableRandomSampler, get_sampler

from .rng import byte_tensor


def capture_dataloader_state(dataloader: Any) -> dict[str, Any]:
    """The position of one prepared dataloader on this process."""
    state: dict[str, Any] = {"iteration": getattr(dataloader, "iteration", None)}
    sampler = _sampler_of(dataloader)
    if isinstance(sampler, SeedableRandomSampler):
        state["sampler"] = {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
    generator = getattr(sampler, "generator", None)
    if isinstance(generator, torch.Generator):
        # A plain RandomSampler draws its permutation from this generator; restoring it makes the
        # epochs after the resumed one shuffle exactly as in an uninterrupted run.
        state["generator"] = generator.get_state()
    if getattr(dataloader, "use_stateful_dataloader", False):
        state["state_dict"] = dataloader.state_dict()
    return state


def restore_dataloader_state(dataloader: Any, state: dict[str, Any]) -> None:
    """Move one prepared dataloader back to the position ``capture_dataloader_state`` recorded."""
    if state.get("iteration") is not None and hasattr(dataloader, "iteration"):
        dataloader.iteration = int(state["iteration"])
    sampler = _sampler_of(dataloader)
    if "sampler" in state and isinstance(sampler, SeedableRandomSampler):
        sampler.epoch = int(state["sampler"]["epoch"])
        sampler.initial_seed = int(state["sampler"]["initial_seed"])
    generator = getattr(sampler, "generator", None)
    if "generator" in state and isinstance(generator, torch.Generator):
        generator.set_state(byte_tensor(state["generator"]))
    if "state_dict" in state and getattr(dataloader, "use_stateful_dataloader", False):
        dataloader.load_state_dict(state["state_dict"])


def _sampler_of(dataloader: Any) -> Any:
    if hasattr(dataloader, "get_sampler"):
        return dataloader.get_sampler()
    if isinstance(dataloader, torch.utils.data.DataLoader):
        return get_sampler(dataloader)
    return None
