"""Parameters written outside step() under the real Trainer: fit completes, one warning, and every checkpoint file
both runs wrote holds stock's values bit for bit, or (a retake) exactly the values at the next step's seal.

Each case trains twice in this process from the same seed and data: stock Lightning (no plugin) and FastCheckpointIO,
ModelCheckpoint saving every step. See docs/lightning.md, "Writes outside step()".
"""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from fastckpt import RetakenSnapshotWarning
from fastckpt.engine.once import WARNED
from fastckpt_lightning import FastCheckpointIO
from helpers import assert_bit_equal
from lightning_support import ResumableBatches, TinyModule, make_trainer

STEPS = 6
CLIP = 0.05


class EmaInOptimizer(TinyModule):
    """An EMA copy of the net whose parameters are also in the optimizer (no grads: never stepped), updated in place
    in ``on_train_batch_end``, after ModelCheckpoint saved."""

    def __init__(self) -> None:
        super().__init__()
        self.ema = copy.deepcopy(self.net)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), self.net.parameters()):
                e.mul_(0.5).add_(p, alpha=0.5)


class WganClip(TinyModule):
    """WGAN weight clipping at the start of ``training_step``, in place or through ``.data`` (no version bump)."""

    def __init__(self, through_data: bool = False) -> None:
        super().__init__()
        self.through_data = through_data

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        with torch.no_grad():
            for p in self.net.parameters():
                (p.data if self.through_data else p).clamp_(-CLIP, CLIP)
        return super().training_step(batch, batch_idx)


class ManualRecipe(TinyModule):
    """Manual optimization with ModelCheckpoint: the recipe of ModelCheckpoint's own docstring (``layer`` and
    ``saved_models``; ModelCheckpoint swaps them in with load_state_dict around each save)."""

    def __init__(self) -> None:
        super().__init__(manual=True)
        self.layer = nn.Linear(16, 1)
        self.saved_models: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(self.net[0](x)[:, :16]), y)
        self.saved_models[batch_idx] = {k: v.detach().clone() for k, v in self.layer.state_dict().items()}
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None


def _fit(make: Callable[[], TinyModule], dirpath: str, plugin: Optional[FastCheckpointIO]) -> None:
    module = make()
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    make_trainer([checkpoint], plugin, max_steps=STEPS).fit(module, ResumableBatches())


def _runs(tmp_path, make: Callable[[], TinyModule]) -> tuple[dict[str, dict], dict[str, dict], int]:
    stock, fast = str(tmp_path / "stock"), str(tmp_path / "fast")
    _fit(make, stock, None)
    WARNED.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(make, fast, FastCheckpointIO())
    warned = sum(issubclass(w.category, RetakenSnapshotWarning) for w in caught)
    names = sorted(set(os.listdir(stock)) & set(os.listdir(fast)), key=lambda n: int(n[5:-5]))
    assert len(names) == STEPS, (os.listdir(stock), os.listdir(fast))
    load = lambda d, n: torch.load(os.path.join(d, n), weights_only=False)  # noqa: E731
    return ({n: load(stock, n) for n in names}, {n: load(fast, n) for n in names}, warned)


def _same_but(a: dict, b: dict, keys: set[str]) -> None:
    """Bit-equal checkpoints apart from the state_dict ``keys`` (the retake's)."""
    assert_bit_equal({k: v for k, v in a["state_dict"].items() if k not in keys},
                     {k: v for k, v in b["state_dict"].items() if k not in keys})
    assert_bit_equal(a["optimizer_states"], b["optimizer_states"])


def test_ema_updated_in_place_after_the_save(tmp_path) -> None:
    stock, fast, warned = _runs(tmp_path, EmaInOptimizer)
    names = list(stock)
    ema = {k for k in stock[names[0]]["state_dict"] if k.startswith("ema.")}
    retaken = [n for n in names if any(not torch.equal(stock[n]["state_dict"][k], fast[n]["state_dict"][k])
                                       for k in ema)]
    # The first save is retaken at the next step's seal, after the EMA update: its EMA holds the values stock saves
    # one step later. The EMA keys are copied inside save() from then on: every later file is stock's, bit for bit.
    assert retaken == [names[0]] and warned == 1
    for i, n in enumerate(names):
        _same_but(stock[n], fast[n], ema)
        want = stock[names[i + 1]] if n in retaken else stock[n]
        assert_bit_equal({k: want["state_dict"][k] for k in ema}, {k: fast[n]["state_dict"][k] for k in ema})


@pytest.mark.parametrize("through_data", [False, True], ids=["in_place", "through_data"])
def test_wgan_clipping_at_the_start_of_training_step(tmp_path, through_data: bool) -> None:
    stock, fast, warned = _runs(tmp_path, lambda: WganClip(through_data))
    names = list(stock)
    net = {k for k in stock[names[0]]["state_dict"] if k.startswith("net.")}
    retaken = [n for n in names if any(not torch.equal(stock[n]["state_dict"][k], fast[n]["state_dict"][k])
                                       for k in net)]
    # Retaken at the next step's seal, after that step's clipping: exactly stock's values, clipped.
    assert retaken == [names[0]] and warned == 1
    for n in names:
        _same_but(stock[n], fast[n], net)
        for k in net:
            want = stock[n]["state_dict"][k]
            want = want.clamp(-CLIP, CLIP) if n in retaken else want
            assert torch.equal(want, fast[n]["state_dict"][k]), (n, k)


def test_manual_optimization_recipe_of_model_checkpoint(tmp_path) -> None:
    """ModelCheckpoint loads the pre-step layer, saves, loads the current one back: the load waits for the copy."""
    stock, fast, warned = _runs(tmp_path, ManualRecipe)
    assert warned == 0
    for n in stock:
        _same_but(stock[n], fast[n], set())
