"""A signal the integrations caught after the last safe point still goes on (issue 54 item 1): Lightning hands it to
its own handler at teardown, Accelerate's ``end_training()`` takes the final checkpoint and then hands it on."""
from __future__ import annotations

import signal
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from safetensors.torch import load_file

from accelerate_testing import closing, fresh_accelerate, make_accelerator  # noqa: F401 (the last two: fixtures)
from fastckpt_lightning import FastCheckpointIO
from helpers import assert_bit_equal
from lightning_support import ResumableBatches, TinyModule, make_trainer


class _SignalAtTrainEnd(Callback):
    """SIGTERM after the last batch end, while the fit is still running (its handlers installed)."""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        signal.raise_signal(signal.SIGTERM)
        self.preempted = trainer.received_sigterm  # only recorded by fastckpt so far


def test_lightning_a_signal_after_the_last_batch_reaches_lightnings_handler_at_teardown(tmp_path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    plugin = FastCheckpointIO(config={"root": str(tmp_path), "persist": {"fsync": False},
                                      "preemption": {"enabled": True, "grace_s": 60}})
    late = _SignalAtTrainEnd()
    trainer = make_trainer([late], plugin, max_steps=3, default_root_dir=str(tmp_path))
    trainer.fit(TinyModule(), ResumableBatches())
    assert late.preempted is False  # held by fastckpt while the fit ran on
    assert trainer.received_sigterm is True  # handed on to Lightning's handler at teardown, once flushed
    assert signal.getsignal(signal.SIGTERM) == before


def test_accelerate_end_training_takes_the_final_checkpoint_then_hands_the_signal_on(tmp_path, closing) -> None:
    from fastckpt_accelerate import enable

    calls: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda s, f: calls.append(s))  # the user's handler
    try:
        accelerator = make_accelerator(tmp_path)
        checkpointing = enable(accelerator, {"persist": {"fsync": False},
                                             "preemption": {"enabled": True, "signals": ["SIGUSR1"]}})
        closing.append(checkpointing)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in range(2):
            accelerator.backward(model(torch.randn(3, 4)).sum())
            opt.step()
            opt.zero_grad()
        accelerator.save_state()
        signal.raise_signal(signal.SIGUSR1)  # after the last step: no safe point comes any more
        assert calls == [] and checkpointing.preemption.preemption.preempted
        want = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        accelerator.end_training()
        assert calls == [signal.SIGUSR1]  # handed on once, after the flush
        final = tmp_path / "checkpoints" / "checkpoint_1"  # the final save_state(), after checkpoint_0
        assert (final / "manifest.json").exists()
        assert_bit_equal(dict(sorted(load_file(str(final / "model.safetensors")).items())), dict(sorted(want.items())))
    finally:
        signal.signal(signal.SIGUSR1, before)
