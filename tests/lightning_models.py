"""The deterministic Lightning model and data of the ``test_lightning*`` tests.

Only torch and Lightning are imported here: processes that must run stock Lightning (no fastckpt in
``sys.modules``) import this module too.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn

BATCH = 4
BATCHES_PER_EPOCH = 4
_GEN = torch.Generator().manual_seed(1234)
INPUTS = torch.randn(BATCH * BATCHES_PER_EPOCH, 16, generator=_GEN)
TARGETS = torch.randn(BATCH * BATCHES_PER_EPOCH, 1, generator=_GEN)


class ResumableBatches:
    """Fixed batches in a fixed order that resume mid-epoch (Lightning saves and restores ``state_dict``)."""

    def __init__(self) -> None:
        self._batches = [(INPUTS[i : i + BATCH], TARGETS[i : i + BATCH]) for i in range(0, len(INPUTS), BATCH)]
        self._start = 0
        self._handed_out = 0

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self):
        start, self._start = self._start, 0
        for index in range(start, len(self._batches)):
            # Lightning asks for the state after the batch trained: count it as handed out before yielding it.
            self._handed_out = index + 1
            yield self._batches[index]

    def state_dict(self) -> dict[str, int]:
        return {"handed_out": self._handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._start = state["handed_out"] % len(self._batches)


class TinyModule(pl.LightningModule):
    """Two linear layers (optionally with BatchNorm), AdamW and a StepLR schedule; deterministic from seed 0."""

    def __init__(self, batchnorm: bool = False, manual: bool = False, width: int = 64) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        norm: nn.Module = nn.BatchNorm1d(width) if batchnorm else nn.Identity()
        self.net = nn.Sequential(nn.Linear(16, width), norm, nn.Tanh(), nn.Linear(width, 1))
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}
