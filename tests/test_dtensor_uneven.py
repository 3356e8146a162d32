"""DTensors of every shape on 2 and 4 gloo ranks: uneven splits and empty local blocks.

FSDP2 splits dim 0 as ``torch.chunk``: ``Linear(5, 1)``'s weight is one row, so on 2 ranks rank 1 holds a [0, 5]
block and on 4 ranks three ranks hold nothing; 5 rows on 4 ranks give 2, 2, 1, 0. Every such state must save from
every rank, load bit for bit, and reshard on load into another world size or placement; a state whose structure
really differs between ranks is refused with the key that differs.

Each world size runs in one process group (the launches are the cost): 2 ranks save, then 4 ranks save and resume
the 2-rank checkpoint; this process (no torch.distributed) loads and consolidates both.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, StateMismatchError, consolidate
from tests.dist_launcher import run_ranks
from tests.helpers import assert_bit_equal

pytestmark = pytest.mark.slow


def _full(state):
    """A plain-tensor deep copy of ``state`` (DTensors gathered; collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.full_tensor().clone()
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _full(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_full(v) for v in state)
    return state


def _model(seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # weights [5, 32] and [1, 5], biases [5] and [1]: uneven on 2 ranks, empty blocks on 2 and 4 ranks
    model = nn.Sequential(nn.Linear(32, 5), nn.ReLU(), nn.Linear(5, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _train_step(model, opt, seed: int) -> None:
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _extras(world: int, grid: bool) -> dict:
    """DTensors of no module: a column split (1 column each on 4 ranks, 2 + 1 on 2), int64 rows split 3 + 2 or
    2, 2, 1, 0, a tensor with no element at all; with ``grid`` (4 ranks), a 2x2 mesh with empty blocks in both dims
    and a replicated dim over an empty shard (HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    out = {"cols": distribute_tensor(torch.arange(6.0).reshape(2, 3) / 7, mesh, [Shard(1)]),
           "rows": distribute_tensor(torch.arange(5) * 1_000_003, mesh, [Shard(0)]),
           "nothing": distribute_tensor(torch.zeros(0, 3), mesh, [Shard(0)])}
    if grid:
        mesh2 = init_device_mesh("cpu", (2, 2))
        out["grid"] = distribute_tensor(torch.arange(3.0).reshape(3, 1) - 0.5, mesh2, [Shard(0), Shard(1)])
        out["hsdp"] = distribute_tensor(torch.arange(4.0).reshape(1, 4) + 0.25, mesh2, [Replicate(), Shard(0)])
    return out


def _save(rank: int, world: int, root: str, out: str) -> dict:
    """Train one step, save it lazily, train on (the pre-hook waits for the copies); check it loads bit for bit,
    reshards into other placements of this mesh, and restores the live model. Returns the values saved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model, opt = _model(0)
    _train_step(model, opt, 1)
    assert model[2].weight.to_local().numel() == (5 if rank == 0 else 0), "rank 0 alone holds Linear(5, 1)'s row"
    with Checkpointer(CheckpointConfig(root=root, persist={"chunk_bytes": 4096}), distributed=True) as ckpt:
        ckpt.watch(opt)
        # "tied": the one-row weight again (tied embeddings): one entry on every rank, empty block or not
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": _extras(world, world == 4),
                 "tied": model.state_dict()["2.weight"], "step": 1}
        ref = _full(state)
        h = ckpt.save(state, step=1)
        _train_step(model, opt, 2)  # no explicit wait: the lazy copies must have seen step 1's values
        h.wait()
        assert not torch.equal(_full(model.state_dict())["2.weight"], ref["model"]["2.weight"])
        loaded = ckpt.load(step=1)
        assert_bit_equal(ref, loaded)
        assert loaded["tied"] is loaded["model"]["2.weight"]

        # reshard on load within this world: matrices split by columns, vectors replicated
        mesh = init_device_mesh("cpu", (world,))
        target = {key: distribute_tensor(torch.full_like(t, -1.0), mesh, [Shard(1) if t.dim() == 2 else Replicate()])
                  for key, t in ref["model"].items()}
        ckpt.load_into({"model": target}, step=1)
        for key, t in target.items():
            assert torch.equal(t.full_tensor(), ref["model"][key]), key

        # the live model and optimizer, empty blocks included, go back to step 1
        restored = ckpt.load_into({"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}, step=1)
        assert restored["step"] == 1
        assert_bit_equal(ref["model"], _full(model.state_dict()))
        assert_bit_equal(ref["optim"]["state"], _full(opt.state_dict()["state"]))
    if rank == 0:
        torch.save(ref, out)
    return ref


def _refused(ckpt: Checkpointer, state: dict, match: str, **kwargs) -> str:
    with pytest.raises(StateMismatchError, match=match) as ei:
        ckpt.save(state, step=9, **kwargs)
    return str(ei.value)


def _two_ranks(rank: int, world: int, root: str, out: str) -> None:
    _save(rank, world, root, out)
    model, opt = _model(0)
    _train_step(model, opt, 1)
    with Checkpointer(CheckpointConfig(root=root + "-bad"), distributed=True) as ckpt:
        ckpt.watch(opt)
        # one rank saves another shape: the key, both shapes and both ranks are named, alike on every rank
        msg = _refused(ckpt, {"a": torch.zeros(2), "b": torch.zeros(3 + rank)}, "'b' as float32")
        assert "[3] (eager" in msg and "on rank 0 but 'b' as float32 [4]" in msg and "on rank 1" in msg, msg
        # one rank alone copies the model eagerly: the first block named, with its copy class on each rank
        msg = _refused(ckpt, {"model": model.state_dict()}, r"'model/0\.weight#dtensor@0,0'",
                       eager=["model/*"] if rank == 1 else ())
        assert "(lazy: a watched optimizer's tensor, a block written by rank 0) on rank 0" in msg, msg
        assert "(eager: no watched optimizer's tensor, a block written by rank 0) on rank 1" in msg, msg
        # one rank has a tensor more: the count and the extra key
        extra = {"x": torch.ones(1)} if rank == 0 else {}
        msg = _refused(ckpt, {"a": torch.zeros(2), **extra}, "2 tensors on rank 0 but 1 on rank 1")
        assert "rank 0 also has 'x'" in msg, msg
        ckpt.save({"a": torch.zeros(2)}, step=10).wait()  # a refusal leaves the Checkpointer usable
        assert torch.equal(ckpt.load(step=10)["a"], torch.zeros(2))


def _four_ranks(rank: int, world: int, root: str, out: str, root2: str, ref2_path: str) -> None:
    _save(rank, world, root, out)
    # resume the 2-rank checkpoint here: 4 ranks, three of them with empty blocks of Linear(5, 1)
    ref2 = torch.load(ref2_path, weights_only=True)
    model, opt = _model(world + 7)
    _train_step(model, opt, 3)  # the optimizer state must exist to be loaded into in place
    assert not torch.equal(_full(model.state_dict())["0.weight"], ref2["model"]["0.weight"])
    extras = _extras(world, grid=False)
    with Checkpointer(CheckpointConfig(root=root2), distributed=True) as ckpt:
        restored = ckpt.load_into({"model": model.state_dict(), "optim": opt.state_dict(), "extra": extras,
                                   "step": 0}, step=1)
    opt.load_state_dict(restored["optim"])
    assert restored["step"] == 1
    assert_bit_equal(ref2["model"], _full(model.state_dict()))
    assert_bit_equal(ref2["optim"]["state"], _full(opt.state_dict()["state"]))
    assert_bit_equal(ref2["extra"], _full(extras))
    assert model[0].weight.to_local().shape[0] == [2, 2, 1, 0][rank], "each rank holds its rows of the new mesh"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, tuple[Path, dict]]:
    tmp = tmp_path_factory.mktemp("uneven")
    run_ranks(_two_ranks, 2, str(tmp / "w2"), str(tmp / "ref2.pt"))
    run_ranks(_four_ranks, 4, str(tmp / "w4"), str(tmp / "ref4.pt"), str(tmp / "w2"), str(tmp / "ref2.pt"))
    return {w: (tmp / f"w{w}", torch.load(tmp / f"ref{w}.pt", weights_only=True)) for w in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_and_empty_blocks_save_load_and_reshard_bit_exact(saved, world: int) -> None:
    root, ref = saved[world]
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:  # one process, no torch.distributed
        assert_bit_equal(ref, ckpt.load(step=1))
        target = {"model": {k: torch.full_like(v, -1.0) for k, v in ref["model"].items()},
                  "extra": {k: torch.full_like(v, -1) for k, v in ref["extra"].items()}}
        restored = ckpt.load_into(target, step=1)
        assert_bit_equal(ref["model"], target["model"])
        assert_bit_equal(ref["extra"], target["extra"])
        assert_bit_equal(ref["optim"], restored["optim"])
    state = consolidate(str(root / "step-000000001"))
    assert_bit_equal(ref, state)
    assert type(state["model"]["2.weight"]) is torch.Tensor and state["model"]["2.weight"].shape == (1, 5)


@pytest.mark.parametrize("world", [2, 4])
def test_empty_blocks_are_not_written(saved, world: int) -> None:
    """An empty block holds no byte: it is left out of the table, and the blocks kept still cover the tensor."""
    root, _ = saved[world]
    ckdir = root / "step-000000001"
    manifest = json.loads((ckdir / "manifest.json").read_text())
    meta = json.loads((ckdir / manifest["meta"]).read_text())
    shapes = {t["key"]: t["shape"] for t in meta["tensors"]}
    records = {d["key"]: d for d in meta["dtensors"]}
    for d in meta["dtensors"]:
        blocks = [shapes[meta["tensors"][i]["key"]] for i in d["entries"]]
        if d["key"] == "extra/nothing":  # no element at all: its first block only, so the tree can refer to it
            assert blocks == [[0, 3]], blocks
        else:
            assert all(all(blocks_dim for blocks_dim in b) for b in blocks), (d["key"], blocks)
    assert records["model/2.weight"]["offsets"] == [[0, 0]]  # one row, rank 0's: the other ranks wrote nothing
    rows = {2: [[0, 0], [3, 0]], 4: [[0, 0], [2, 0], [4, 0]]}[world]
    assert records["model/0.weight"]["offsets"] == rows
    if world == 4:
        assert records["extra/grid"]["offsets"] == [[0, 0], [2, 0]]  # the mesh's second column holds nothing
        assert records["extra/hsdp"]["offsets"] == [[0, 0]]  # replicas of rank 0's row, written once
