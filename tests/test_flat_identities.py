"""``FlatState.identities``: what ``flatten`` records of each tensor as it walks, so that a save asks torch for a
tensor's identity once, not three times, must be exactly ``address()`` of its source, whatever the tensor."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastckpt.format.identity import address
from fastckpt.format.plan import FlatState, Planner, flatten


def _state() -> dict:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(16, 4)
    head = torch.nn.Linear(4, 16, bias=False)
    head.weight = emb.weight  # tied: one entry
    base = torch.arange(12.0)
    return {
        "model": {**emb.state_dict(prefix="emb."), **head.state_dict(prefix="head.")},
        "param": torch.nn.Parameter(torch.ones(3)),  # keep_vars-style: a Parameter, not a plain tensor
        "empty": torch.empty(0),  # no data address: matched by its storage
        "empty_alias": torch.empty(0)[:0],
        "view": base[4:8],  # starts inside another tensor's memory
        "base": base,
        "numpy": np.arange(5, dtype=np.float32),
        "step": torch.tensor(7.0),
        "nested": [{"x": torch.zeros(2, 2)}, (torch.ones(1, dtype=torch.int64),)],
    }


def test_flatten_records_each_tensors_address_as_it_walks():
    flat = flatten(_state())
    assert len(flat.ids) == len(flat.lazy_src) == len(flat.tensors)
    assert flat.ids == [address(src) for src in flat.lazy_src]
    assert flat.identities() is flat.ids  # recorded: not asked of torch again
    empty = flat.ids[flat.keys.index("empty")]
    assert isinstance(empty, tuple) and empty[0] == "storage"  # never 0: an empty tensor matches no other by accident


def test_identities_are_computed_where_a_save_path_builds_the_table_itself():
    tensors = [torch.ones(3), torch.empty(0), torch.arange(4)]
    flat = FlatState(tree=None, tensors=tensors, keys=["a", "b", "c"], numpy=[False] * 3, objects=[],
                     owners=[-1] * 3, lazy_src=list(tensors))
    assert flat.identities() == [address(t) for t in tensors]
    flat.tensors.append(torch.zeros(2)), flat.lazy_src.append(flat.tensors[-1])  # grown after: asked again
    assert flat.identities() == [address(t) for t in flat.lazy_src]


@pytest.mark.parametrize("lazy_keys", [set(), {"model/emb.weight", "step"}, {"base", "view", "numpy", "param"}])
def test_a_plan_from_identities_marks_lazy_what_address_names(lazy_keys):
    flat = flatten(_state())
    lazy = {i for i, k in zip(flat.ids, flat.keys) if k in lazy_keys}
    by_ids = Planner(1 << 20).plan(flat, lazy)
    expected = [(not n) and address(src) in lazy for src, n in zip(flat.lazy_src, flat.numpy)]
    assert [by_ids.entries[i].lazy for i in range(len(flat.tensors))] == expected
    lazy_now = {flat.keys[e.index] for e in by_ids.entries if e.lazy}
    assert lazy_now == lazy_keys - {"numpy"}  # a numpy array is never lazy: it is no optimizer's tensor


def test_address_read_is_address_given_the_pointer_already_read():
    from fastckpt.format.identity import address_read

    for t in (torch.ones(3), torch.nn.Parameter(torch.ones(2)), torch.empty(0), torch.arange(8.0)[2:5],
              torch.tensor(1.0)):
        assert address_read(t, t.data_ptr()) == address(t)
