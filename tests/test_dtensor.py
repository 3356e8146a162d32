"""DTensor / FSDP2 state: each rank writes its own blocks; loading reassembles or reshards (gloo ranks)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, ConfigError, IntegrityError, StateMismatchError, consolidate
from fastckpt.storage.protocol import open_storage
from tests.dist_launcher import run_ranks
from tests.helpers import WrappedStorage, assert_bit_equal

pytestmark = pytest.mark.slow


class RecordingStorage(WrappedStorage):
    """Remembers which data files this rank wrote."""

    def __init__(self, inner):
        super().__init__(inner)
        self.written: list[str] = []

    def write_file(self, path, parts):
        self.written.append(path.rsplit("/", 1)[-1])
        self.inner.write_file(path, parts)


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


def _fsdp_model(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    # 33 rows over 2 ranks: an uneven split (17 + 16); 1-D biases are sharded too.
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 8))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _train_step(model, opt, seed: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _fsdp_save_and_reshard(rank: int, world: int, root: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    model, opt = _fsdp_model()
    _train_step(model, opt, 1)
    storage = RecordingStorage(open_storage(root))
    cfg = CheckpointConfig(root=root, persist={"chunk_bytes": 4096})
    with Checkpointer(cfg, storage=storage, distributed=True) as ckpt:
        ckpt.watch(opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
        assert isinstance(state["model"]["0.weight"], DTensor)
        ref = _full(state)  # the values at save() time
        h = ckpt.save(state, step=1)
        _train_step(model, opt, 2)  # no explicit wait: the step pre-hook waits for the lazy copies
        h.wait()
        assert not torch.equal(model.state_dict()["0.weight"].full_tensor(), ref["model"]["0.weight"])
        plans = ckpt.counters["plans_built"], ckpt.counters["host_allocations"]
        ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}, step=2).wait()
        assert (ckpt.counters["plans_built"], ckpt.counters["host_allocations"]) == plans  # same plan, same buffers
        assert any(name.startswith("shard-") for name in storage.written), "every rank writes its own blocks"

        # load(): full plain tensors on every rank
        assert_bit_equal(ref, ckpt.load(step=1))

        # load_into() DTensors of another placement: Shard(1) for matrices, Replicate for vectors
        mesh = init_device_mesh("cpu", (world,))
        target = {key: distribute_tensor(torch.zeros_like(t), mesh, [Shard(1) if t.dim() == 2 else Replicate()])
                  for key, t in ref["model"].items()}
        ckpt.load_into({"model": target}, step=1)
        for key, t in target.items():
            assert t.placements[0] == (Shard(1) if t.dim() == 2 else Replicate())
            assert torch.equal(t.full_tensor(), ref["model"][key]), key

        # load_into() the live FSDP2 model and optimizer: training resumes from step 1 exactly
        live = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
        restored = ckpt.load_into(live, step=1)
        assert restored["step"] == 1
        assert_bit_equal(ref["model"], _full(model.state_dict()))
        assert_bit_equal(ref["optim"]["state"], _full(opt.state_dict()["state"]))

        # a replicated DTensor (HSDP's replica dim) is one block, written once by rank 0
        rep = distribute_tensor(torch.arange(6.0), mesh, [Replicate()])
        ckpt.save({"r": rep}, step=3).wait()
        reader = ckpt.reader(step=3)
        assert [d.offsets for d in reader.dtensors] == [[(0,)]] and len(reader.entries) == 1
        assert torch.equal(ckpt.load(step=3)["r"], torch.arange(6.0))

        with pytest.raises(StateMismatchError, match="Partial"):
            ckpt.save({"p": DTensor.from_local(torch.ones(4), mesh, [Partial()])}, step=9)
    with Checkpointer(cfg) as alone, pytest.raises(ConfigError, match="distributed=True"):
        alone.save({"w": distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])}, step=9)
    if rank == 0:
        torch.save(ref, out)
    dist.barrier()


def _single_rank_mesh(rank: int, world: int, root: str) -> None:
    """A DTensor on a 1-rank mesh needs no distributed Checkpointer; BatchNorm-like buffers stay eager."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    w = distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)])
    with Checkpointer(CheckpointConfig(root=root)) as ckpt:
        ckpt.save({"w": w, "tied": w, "plain": torch.ones(2)}, step=1).wait()
        got = ckpt.load()
        assert torch.equal(got["w"], torch.arange(12.0).reshape(3, 4)) and got["tied"] is got["w"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("fsdp")
    root, out = tmp / "ckpt", tmp / "ref.pt"
    run_ranks(_fsdp_save_and_reshard, 2, str(root), str(out))
    return root, torch.load(out, weights_only=True)


def test_fsdp2_save_is_bit_exact_and_reshards_on_load(fsdp_run) -> None:
    root, ref = fsdp_run
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:  # one process, no torch.distributed
        assert_bit_equal(ref, ckpt.load(step=1))
        target = {"model": {k: torch.full_like(v, -1.0) for k, v in ref["model"].items()}}
        restored = ckpt.load_into(target, step=1)  # plain full tensors: every block lands in its place
        assert_bit_equal(ref["model"], target["model"])
        assert_bit_equal(ref["optim"], restored["optim"])  # what the target lacks is reassembled fresh


def test_dtensor_blocks_are_plain_safetensors(fsdp_run) -> None:
    root, ref = fsdp_run
    ckdir = root / "step-000000001"
    manifest = json.loads((ckdir / "manifest.json").read_text())
    assert manifest["version"] == 2  # a version-1 reader must refuse it instead of loading blocks as tensors
    meta = json.loads((ckdir / manifest["meta"]).read_text())
    weight = next(d for d in meta["dtensors"] if d["key"] == "model/0.weight")
    assert weight["shape"] == [33, 16] and weight["offsets"] == [[0, 0], [17, 0]]
    blocks = {}
    for name in manifest["files"]:
        if name.startswith("shard-"):
            with safe_open(str(ckdir / name), "pt") as f:
                blocks.update({k: f.get_tensor(k) for k in f.keys()})
    top, bottom = blocks["model/0.weight#dtensor@0,0"], blocks["model/0.weight#dtensor@17,0"]
    assert torch.equal(torch.cat([top, bottom]), ref["model"]["0.weight"])


def test_corrupt_block_names_the_file_and_tensor(fsdp_run, tmp_path) -> None:
    import shutil

    root, _ = fsdp_run
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    ckdir = copy / "step-000000001"
    meta = json.loads((ckdir / json.loads((ckdir / "manifest.json").read_text())["meta"]).read_text())
    row = next(t for t in meta["tensors"] if t["key"] == "model/0.weight#dtensor@17,0")
    path = ckdir / row["file"]
    data = bytearray(path.read_bytes())
    data[row["offset"] + 5] ^= 0x40
    path.write_bytes(bytes(data))
    with Checkpointer(CheckpointConfig(root=str(copy))) as ckpt:
        with pytest.raises(IntegrityError, match=rf"{row['file']}.*model/0.weight#dtensor@17,0"):
            ckpt.load(step=1)


def test_dtensor_on_a_one_rank_mesh(tmp_path) -> None:
    run_ranks(_single_rank_mesh, 1, str(tmp_path))


def _fsdp_save(rank: int, world: int, root: str, out: str) -> None:
    """Train one step on ``world`` ranks, save it; rank 0 keeps the full values for the resumed run."""
    model, opt = _fsdp_model()
    _train_step(model, opt, 1)
    with Checkpointer(CheckpointConfig(root=root, persist={"chunk_bytes": 4096}), distributed=True) as ckpt:
        ckpt.watch(opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
        ref = _full(state)
        ckpt.save(state, step=1)
        _train_step(model, opt, 2)  # the lazy copies must have seen step 1's values, not these
    if rank == 0:
        torch.save(ref, out)


def _fsdp_resume(rank: int, world: int, root: str, ref_path: str) -> None:
    """A fresh FSDP2 model on ``world`` ranks (another init) resumes step 1 bit for bit: blocks are resharded."""
    ref = torch.load(ref_path, weights_only=True)
    model, opt = _fsdp_model(seed=world + 7)
    _train_step(model, opt, 3)  # the optimizer state must exist to be loaded into in place
    assert not torch.equal(_full(model.state_dict())["0.weight"], ref["model"]["0.weight"])
    with Checkpointer(CheckpointConfig(root=root), distributed=True) as ckpt:
        restored = ckpt.load_into({"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}, step=1)
    opt.load_state_dict(restored["optim"])
    assert restored["step"] == 1
    assert_bit_equal(ref["model"], _full(model.state_dict()))
    assert_bit_equal(ref["optim"]["state"], _full(opt.state_dict()["state"]))
    local = model.state_dict()["0.weight"].to_local()
    rows = -(-33 // world)  # FSDP2 splits as torch.chunk: the last rank may hold fewer
    assert local.shape[0] == min(rows, 33 - rank * rows), "each rank holds its own rows of the new mesh"


def test_fsdp2_four_ranks_resume_into_two(tmp_path) -> None:
    root, ref = tmp_path / "ckpt", tmp_path / "ref.pt"
    run_ranks(_fsdp_save, 4, str(root), str(ref))
    run_ranks(_fsdp_resume, 4, str(root), str(ref))  # same world: plain bit-exact resume
    run_ranks(_fsdp_resume, 2, str(root), str(ref))


def test_fsdp2_two_ranks_resume_into_one(fsdp_run, tmp_path) -> None:
    root, ref = fsdp_run
    torch.save(ref, tmp_path / "ref.pt")
    run_ranks(_fsdp_resume, 2, str(root), str(tmp_path / "ref.pt"))
    run_ranks(_fsdp_resume, 1, str(root), str(tmp_path / "ref.pt"))


def test_consolidate_gives_full_plain_tensors(fsdp_run) -> None:
    root, ref = fsdp_run
    state = consolidate(str(root / "step-000000001"))  # no torch.distributed in this process
    assert_bit_equal(ref, state)
    assert type(state["model"]["0.weight"]) is torch.Tensor and state["model"]["0.weight"].shape == (33, 16)
