"""save_state(), then model.load_state_dict(random weights), then load_state(): the saved values, bit for bit.

Accelerate's own tests do exactly this. The load writes every parameter in place right after save_state() returned,
while the lazy copy may still read them, and before the snapshot is sealed (at the next step, wait or load_state):
the model's load_state_dict pre-hook (fastckpt_accelerate/watcher.py) lets the copy finish and seals first, so the
checkpoint is neither refused nor retaken with the random weights.
"""
from __future__ import annotations

import pytest
import torch

import fastckpt_accelerate
from accelerate_testing import Setup, assert_same, clone, closing, fresh_accelerate, make_accelerator  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("on_mutation", ["retake", "raise"])
def test_load_state_dict_right_after_save_state_keeps_the_saved_values(tmp_path, closing, on_mutation) -> None:
    acc = make_accelerator(tmp_path)
    checkpointing = fastckpt_accelerate.enable(acc, {"staging": {"on_mutation": on_mutation}})
    closing.append(checkpointing)
    setup = Setup(acc)
    for _ in range(2):
        setup.step()
    model = acc.unwrap_model(setup.model)
    for round in range(3):
        expected = clone(model.state_dict())
        optim = clone(setup.optimizer.state_dict())
        path = acc.save_state()
        model.load_state_dict({k: torch.randn_like(v) if v.is_floating_point() else v
                               for k, v in model.state_dict().items()})
        acc.load_state(path)
        assert_same(expected, model.state_dict())
        assert_same(optim, setup.optimizer.state_dict())
        setup.step()
    checkpointing.wait()
    assert [i.name for i in checkpointing.checkpointer.list()][-3:] == [f"checkpoint_{i}" for i in range(3)]
