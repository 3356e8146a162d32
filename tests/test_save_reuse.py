"""save() reuses the previous save's flattening, plan and seal layout when the state passes the identity check
(fastckpt/format/flatcache.py), and never when it does not: every checkpoint restores bit for bit either way.

The figures that motivate it are benchmarks' (``python -m benchmarks.save_call``); here only structural facts are
asserted: what was reused (counters, object identity), and that a steady-state save() makes no Python call per
tensor (``sys.setprofile`` counts the calls of the training thread: doubling the tensors must not add any).
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import Any, Callable

import pytest
import torch
from torch import nn

from fastckpt import Checkpointer, CheckpointConfig, SnapshotMutatedError
from fastckpt.format.flatcache import FlatCache, tree_json
from fastckpt.format.plan import flatten
from tests.helpers import assert_bit_equal, bounded, clone_state


def _model(n: int = 4, width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)])


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(2, model[0].in_features)).pow(2).sum().backward()
    opt.step()  # its pre-hook seals the pending snapshot


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "lr": 1e-3 / (step + 1)}


def _ckpt(tmp_path) -> Checkpointer:
    return Checkpointer(CheckpointConfig(root=str(tmp_path), staging={"mode": "lazy"}))


def _reused(ckpt: Checkpointer) -> tuple[int, int, int]:
    """(flattenings reused, skeletons built, plans returned without a key built) so far."""
    saver = ckpt._saver
    return saver._flats.reused, saver._flats.built, saver._planner.reused


def test_a_steady_state_save_reuses_the_flattening_the_plan_and_the_seal_layout(tmp_path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt)
    refs = {}
    with _ckpt(tmp_path) as ckpt:
        ckpt.watch(opt)
        layouts = []
        for step in range(1, 5):
            state = _state(model, opt, step)  # a fresh state_dict() every time, as a training loop makes it
            refs[step] = clone_state(state)
            ckpt.save(state, step)
            layouts.append(ckpt._saver._flats._skeleton.memo["seal"][1])
            _train(model, opt)
        ckpt.wait()
        assert _reused(ckpt) == (3, 1, 3)
        assert all(layout is layouts[0] for layout in layouts)  # the seal's sampling positions: derived once
        assert ckpt._saver._planner.plans_built == 1
        for step, ref in refs.items():
            assert_bit_equal(ckpt.load(step), ref)


def _reorder(sd: dict) -> None:
    items = list(sd.items())
    sd.clear()
    sd.update(reversed(items))


def _set_data(p: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> None:
    p.data = make(p.data)  # what weight surgery does; the version counter does not move


MODEL_CHANGES: dict[str, Callable[[nn.Module], None]] = {  # applied to the model once
    "a parameter re-allocated": lambda m: _set_data(m[1].weight, torch.clone),
    "a parameter reshaped in place": lambda m: _set_data(m[1].bias, lambda d: d.view(8, 8)),
    "a parameter viewed as another dtype": lambda m: _set_data(m[2].bias.requires_grad_(False),
                                                               lambda d: d.view(torch.int32)),
    "a parameter transposed in place": lambda m: _set_data(m[2].weight, lambda d: d.t()),
    "a parameter as a neg view": lambda m: _set_data(m[3].bias, torch._neg_view),
}
_OTHER, _EXTRA = torch.randn(64, 64), torch.arange(5.0)  # the same tensors in every state from the change on
STATE_CHANGES: dict[str, Callable[[dict], None]] = {  # applied to every state from then on
    "a tensor replaced": lambda st: st["model"].__setitem__("0.weight", _OTHER),
    "a key added": lambda st: st["model"].__setitem__("extra", _EXTRA),
    "the keys reordered": lambda st: _reorder(st["model"]),
    "a container's type": lambda st: st.__setitem__("model", dict(st["model"])),
    "a leaf's type": lambda st: st.__setitem__("step", float(st["step"])),
}


@pytest.mark.parametrize("change", list(MODEL_CHANGES) + list(STATE_CHANGES))
def test_nothing_is_reused_once_the_state_changed(tmp_path, change: str) -> None:
    """A change the identity check must see: the save after it is flattened in full (its skeleton then reused),
    and every checkpoint, before, at and after the change, restores bit for bit."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = {}
    with _ckpt(tmp_path) as ckpt:
        ckpt.watch(opt)
        for step in range(1, 5):
            if step == 3 and change in MODEL_CHANGES:
                ckpt.wait()  # the change itself must not be refused as a write after save()
                with torch.no_grad():
                    MODEL_CHANGES[change](model)
            state = _state(model, opt, step)
            if step >= 3 and change in STATE_CHANGES:
                STATE_CHANGES[change](state)
            refs[step] = clone_state(state)
            ckpt.save(state, step)
            if step == 3:
                assert _reused(ckpt)[:2] == (1, 2), "the changed state passed the identity check"
            if change in STATE_CHANGES or step < 3:
                _train(model, opt)
            else:
                ckpt.wait()  # a reshaped or retyped parameter trains no more
        assert _reused(ckpt)[:2] == (2, 2)
        ckpt.wait()
        for step, ref in refs.items():
            assert_bit_equal(ckpt.load(step), ref)


_X, _Y, _Z = torch.randn(16), torch.randn(16), torch.randn(16)
PER_PARAM = {  # an optimizer-state-like dict of flat dicts, compared as one list of keys and one of counts
    "as saved before": lambda: {0: {"a": _X, "b": _Y}, 1: {"c": _Z}},
    "a key renamed": lambda: {0: {"a": _X, "B": _Y}, 1: {"c": _Z}},
    "a key moved to the next dict": lambda: {0: {"a": _X}, 1: {"b": _Y, "c": _Z}},  # the same keys in one list
    "a dict's type": lambda: {0: OrderedDict(a=_X, b=_Y), 1: {"c": _Z}},
}


@pytest.mark.parametrize("change", [c for c in PER_PARAM if c != "as saved before"])
def test_a_changed_per_parameter_dict_is_not_reused(tmp_path, change: str) -> None:
    """The dicts of an optimizer's per-parameter state are checked together (their types, their key counts, all their
    keys as one list): a key renamed, or moved into the next dict (the keys in the same order overall), is seen."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    refs = {}
    with _ckpt(tmp_path) as ckpt:
        ckpt.watch(opt)
        for step in range(1, 5):
            state = _state(model, opt, step)
            state["per_param"] = PER_PARAM[change if step >= 3 else "as saved before"]()
            refs[step] = clone_state(state)
            ckpt.save(state, step)
            if step == 3:
                assert _reused(ckpt)[:2] == (1, 2), "the changed state passed the identity check"
            _train(model, opt)
        assert _reused(ckpt)[:2] == (2, 2)
        ckpt.wait()
        for step, ref in refs.items():
            assert_bit_equal(ckpt.load(step), ref)


def test_the_deferred_tree_is_the_tree_flatten_encodes() -> None:
    """Plain leaves change from save to save (a step, a learning rate, NaN, a huge int): each save's tree is
    encoded later, from its own values, exactly as ``flatten`` encodes it."""
    model = _model(2)
    cache = FlatCache()
    floats, ints, strs = [1.5, float("nan"), -0.0, float("inf")], [1, 2 ** 70, -5, 0], ["a", "", "b", "\u00e9"]
    for i, (f, n, text) in enumerate(zip(floats, ints, strs)):
        state = {"model": model.state_dict(), "f": f, "n": n, "s": text, "none": None, "flag": i % 2 == 0,
                 "k": {1: b"ab", 2.5: torch.float16, None: (1, [2.0])}, "size": torch.Size([3, i]),
                 "dev": torch.device("cpu"), "od": OrderedDict(a=i), "obj": ValueError(i)}
        flat = cache.flatten(state)
        assert cache.reused == i
        assert repr(tree_json(flat.tree)) == repr(flatten(state).tree)  # NaN != NaN: compared as text
        assert [type(o) for o in flat.objects] == [ValueError] and flat.objects[0].args == (i,)


def _calls_in(fn: Callable[[], Any]) -> int:
    """Python and C function calls made from Python code by this thread while ``fn`` runs (C functions that C
    calls, such as ``map``'s, are not events: what counts is the Python work)."""
    count = 0

    def profile(_frame, event, _arg) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def _steady_calls(tmp_path, layers: int) -> int:
    """The fewest calls of the steady-state saves (a busy host may move the training thread to another CPU, and
    the background threads are then placed anew: calls that depend on the host, not on the state)."""
    model = _model(layers, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt)
    calls = []
    with _ckpt(tmp_path / str(layers)) as ckpt:
        ckpt.watch(opt)
        for step in range(1, 6):
            state = _state(model, opt, step)
            ckpt.wait()  # the same pending saves (none) before each: only the state's size differs
            calls.append(_calls_in(lambda: ckpt.save(state, step)))
            _train(model, opt)
        assert _reused(ckpt) == (4, 1, 4)
    return min(calls[1:])


def test_a_steady_state_save_makes_no_python_call_per_tensor(tmp_path) -> None:
    """30 tensors or 60 (and 60 or 120 optimizer state tensors): a reused save() makes the same calls, give or take
    the few a random draw makes; one call a tensor would add at least 90."""
    small, large = _steady_calls(tmp_path, 15), _steady_calls(tmp_path, 30)
    assert abs(large - small) < 30, (small, large)


def test_a_data_write_after_a_reused_save_is_still_refused(tmp_path) -> None:
    """The seal of a save whose layout was reused compares this save's bytes: a ``.data`` write (no counter moves)
    after the third save is found at the next step."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _ckpt(tmp_path) as ckpt:
        ckpt.watch(opt)
        for step in range(1, 3):
            ckpt.save(_state(model, opt, step), step)
            _train(model, opt)
        handle = ckpt.save(_state(model, opt, 3), 3)
        assert _reused(ckpt)[0] == 2
        model[1].bias.data.mul_(2.0)  # skips the version counter; a small tensor: compared whole
        bounded(lambda: _train(model, opt), 30)
        with pytest.raises(SnapshotMutatedError, match="model/1.bias"):
            bounded(handle.wait, 30)
        assert [info.step for info in ckpt.list()] == [1, 2]


def test_the_watched_optimizers_identities_are_walked_again_exactly_when_they_change() -> None:
    """engine/watch.py's ``WatchedCache``: the same answer object while the optimizers hold the same tensors at the
    same addresses, and ``watched_identities`` anew after any change that moves one (a parameter re-allocated, a
    state tensor replaced, a state value that was None becoming a tensor, a parameter group added)."""
    from fastckpt.engine.watch import WatchedCache, watched_identities

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cache = WatchedCache()
    first = cache.get([opt])
    assert first == watched_identities([opt]) and cache.get([opt]) is first
    _train(model, opt)  # momentum buffers appear in the state
    changes: list[Callable[[], None]] = [
        lambda: None,
        lambda: _set_data(model[0].weight, torch.clone),
        lambda: opt.state[model[1].bias].__setitem__("momentum_buffer", torch.zeros(64)),
        lambda: opt.state[model[2].bias].__setitem__("momentum_buffer", None),
        lambda: opt.state[model[2].bias].__setitem__("momentum_buffer", torch.ones(64)),
        lambda: opt.add_param_group({"params": [nn.Parameter(torch.randn(3))]}),
    ]
    last = first
    for change in changes:
        change()
        got = cache.get([opt])
        assert got == watched_identities([opt])
        assert (got is not last) == (got != last)  # walked again only when the identities changed
        assert cache.get([opt]) is got
        last = got



def _lazy_addresses(ckpt: Checkpointer) -> set[int]:
    """The data addresses of the tensors the last save's plan copies lazily (its state's token holds them)."""
    token, _, _, plan = ckpt._saver._planner._last
    return {token.ids[e.index] for s in plan.shards for e in s.entries if e.lazy}


def test_a_reused_state_takes_the_watched_identities_without_walking_the_optimizers(tmp_path, monkeypatch) -> None:
    """engine/watch.py: a state that passed the identity check, saved with the same optimizers, gets the last
    answer without ``_fingerprint`` (a map over every parameter and state tensor); an optimizer watched since walks
    again, and its tensors are copied lazily from that save on."""
    from fastckpt.engine import watch

    walks = []
    real = watch._fingerprint
    monkeypatch.setattr(watch, "_fingerprint", lambda opts: walks.append(1) or real(opts))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt)
    extra = nn.Parameter(torch.randn(64, 64))
    refs = {}
    with _ckpt(tmp_path) as ckpt:
        ckpt.watch(opt)
        counts = []
        for step in range(1, 5):
            state = {**_state(model, opt, step), "extra": extra.detach()}
            refs[step] = clone_state(state)
            ckpt.save(state, step)
            counts.append(len(walks))
            _train(model, opt)
        assert _reused(ckpt)[0] == 3
        assert counts[1] > 0 and counts[-1] == counts[1], counts  # after the first reuse: no walk at all
        assert extra.data_ptr() not in _lazy_addresses(ckpt)
        opt2 = torch.optim.SGD([extra], lr=0.1)
        ckpt.watch(opt2)  # the same state structure, another optimizer: walked again
        state = {**_state(model, opt, 5), "extra": extra.detach()}
        refs[5] = clone_state(state)
        ckpt.save(state, 5)
        assert _reused(ckpt)[0] == 4 and len(walks) > counts[-1]
        assert extra.data_ptr() in _lazy_addresses(ckpt)
        ckpt.wait()
        for step, ref in refs.items():
            assert_bit_equal(ckpt.load(step=step), ref)


def test_a_parameter_group_added_makes_its_tensors_lazy_at_the_next_save(tmp_path) -> None:
    """A layer unfrozen mid-training (a fine-tuning callback adding a parameter group): a state made anew from the
    model and the optimizer changes structure, so the next save walks the optimizers and copies the new group's
    parameters lazily, not inside ``save()``; every checkpoint restores bit for bit."""
    body = _model(3)
    head = nn.Linear(64, 64)
    opt = torch.optim.SGD(body.parameters(), lr=0.1, momentum=0.9)
    _train(body, opt)
    full = nn.ModuleDict({"body": body, "head": head})
    refs = {}
    with _ckpt(tmp_path) as ckpt:
        ckpt.watch(opt)
        for step in range(1, 4):
            state = {"model": full.state_dict(), "optim": opt.state_dict(), "step": step}
            refs[step] = clone_state(state)
            ckpt.save(state, step)
            _train(body, opt)
        assert _reused(ckpt)[0] == 2
        assert head.weight.data_ptr() not in _lazy_addresses(ckpt)
        assert body[0].weight.data_ptr() in _lazy_addresses(ckpt)
        opt.add_param_group({"params": list(head.parameters())})
        state = {"model": full.state_dict(), "optim": opt.state_dict(), "step": 4}
        refs[4] = clone_state(state)
        ckpt.save(state, 4)
        assert {head.weight.data_ptr(), head.bias.data_ptr()} <= _lazy_addresses(ckpt)
        ckpt.wait()
        for step, ref in refs.items():
            assert_bit_equal(ckpt.load(step=step), ref)
