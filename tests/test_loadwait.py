"""``load_state_dict`` as a safe point (fastckpt/engine/loadwait.py): the wait runs before a load, the hooked model
still pickles (Lightning's ddp_spawn, Accelerate's own pickling tests) into an inert copy, and the hook holds its
target weakly."""
from __future__ import annotations

import gc
import pickle

import torch
from torch import nn

from fastckpt.engine.loadwait import foreign_load_hooks, guard_loads


class Waiter:
    def __init__(self) -> None:
        self.calls = 0

    def wait(self) -> None:
        self.calls += 1


def test_a_load_waits_first_and_the_hooked_model_pickles_into_an_inert_copy() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    waiter = Waiter()
    handles = guard_loads(model, waiter.wait)
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    assert waiter.calls >= 1
    model[0].load_state_dict({k: torch.ones_like(v) for k, v in model[0].state_dict().items()})  # a submodule too
    calls = waiter.calls
    copy = pickle.loads(pickle.dumps(model))  # a local function as the hook made this raise
    copy.load_state_dict(state)
    assert waiter.calls == calls  # the copy's hook is inert: it belongs to no pending save
    assert not foreign_load_hooks(model) and not foreign_load_hooks(copy)
    for h in handles:
        h.remove()


def test_the_hook_holds_its_target_weakly_and_user_hooks_count_as_foreign() -> None:
    model = nn.Linear(4, 4)
    waiter = Waiter()
    guard_loads(model, waiter.wait)
    del waiter
    gc.collect()
    model.load_state_dict(model.state_dict())  # the plugin is gone: nothing to wait for, no error
    model.register_load_state_dict_pre_hook(lambda *a: None)
    assert foreign_load_hooks(model)
