"""Accelerate FSDP2 (``fsdp_version=2``, ``SHARDED_STATE_DICT``) saving through fastckpt, on 2 gloo processes.

Accelerate 1.15 makes an ``fsdp_plugin`` ``DistributedType.FSDP`` only on GPU-like devices; everything after that
gate (``fully_shard`` in ``prepare``, stock's DCP save and load) runs on CPU with gloo. So each rank builds a plain
Accelerator and sets the two fields the gate decides (``distributed_type``, ``fsdp_plugin``): the model is then
really FSDP2-sharded by Accelerate's own ``prepare``, and stock ``save_state`` really writes its DCP folders.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.dist_launcher import run_ranks

pytestmark = pytest.mark.timeout(180)


def _accelerator(project: str, seed: int, state_dict_type: str = "SHARDED_STATE_DICT") -> tuple[Any, Any, Any]:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, ProjectConfiguration

    import torch.distributed as dist

    # what a launcher sets, with cpu=True: Accelerate then sees MULTI_CPU, 2 processes on the gloo group (already
    # initialized by tests/dist_launcher.py through a FileStore: the address only satisfies Accelerate's check)
    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "1")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, project_config=ProjectConfiguration(project_dir=project))
    acc.state.distributed_type, acc.state.fsdp_plugin = DistributedType.FSDP, plugin  # the GPU-only gate
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    acc.state.distributed_type = DistributedType.FSDP  # prepare() re-derives it from the device
    assert (acc.num_processes, acc.process_index) == (dist.get_world_size(), dist.get_rank())
    _step(acc, model, opt, seed)
    return acc, model, opt


def _step(acc: Any, model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(100 + seed)
    acc.backward(model(torch.randn(4, 8)).sum())
    opt.step()
    opt.zero_grad()


def _full(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and optimizer state, gathered whole (collective), keyed by a path."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, tree: Any) -> None:
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(tree, (list, tuple)):
            for i, v in enumerate(tree):
                walk(f"{prefix}/{i}", v)
        elif isinstance(tree, torch.Tensor):
            t = tree.full_tensor() if hasattr(tree, "full_tensor") else tree
            out[prefix] = t.detach().clone()

    walk("model", get_model_state_dict(model))
    walk("optim", get_optimizer_state_dict(model, opt))
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: differ bit for bit at {bad}"


def _save_and_load(rank: int, world: int, tmp: str) -> None:
    import fastckpt_accelerate
    from fastckpt.errors import ConfigError

    acc, model, opt = _accelerator(f"{tmp}/p0", seed=0)
    full_acc = acc.state.fsdp_plugin
    acc.state.fsdp_plugin = type(full_acc)(fsdp_version=2, state_dict_type="FULL_STATE_DICT")
    with pytest.raises(ConfigError, match="SHARDED_STATE_DICT"):
        fastckpt_accelerate.enable(acc)
    acc.state.fsdp_plugin = full_acc
    fast = fastckpt_accelerate.enable(acc, {"root": f"{tmp}/p0/checkpoints"})
    at_save = _full(model, opt)
    acc.step = 5  # as after 5 accumulated steps: restored by load_state
    torch.manual_seed(1000 + rank)  # each process's own RNG, restored on that process
    fast_dir = acc.save_state(f"{tmp}/fast")
    rng_at_save = torch.get_rng_state()
    type(acc).save_state(acc, f"{tmp}/stock")  # stock Accelerate's FSDP2 save of the same state (DCP)
    _step(acc, model, opt, 9)  # training goes on: the fast save must hold the state at save_state
    acc.wait_for_everyone()  # routed: the fast save is committed on every process after this
    if rank == 0:
        torch.save(at_save, f"{tmp}/expected.pt")
        assert os.path.isfile(f"{fast_dir}/manifest.json")
        assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(os.listdir(f"{tmp}/stock"))
    assert fast_dir == f"{tmp}/fast"
    fast.close()

    for seed, folder in ((1, f"{tmp}/fast"), (2, f"{tmp}/stock")):  # load_state reads both layouts
        acc2, model2, opt2 = _accelerator(f"{tmp}/p{seed}", seed=seed)
        loader = fastckpt_accelerate.enable(acc2, {"root": f"{tmp}/p{seed}/checkpoints"})
        acc2.load_state(folder)
        assert torch.equal(torch.get_rng_state(), rng_at_save), f"rank {rank}: {folder}: this process's RNG"
        assert acc2.step == 5, folder
        _assert_equal(_full(model2, opt2), at_save, f"rank {rank}: {folder} loaded")
        if folder.endswith("fast"):
            assert acc2.project_configuration.iteration == 1, "past the loaded folder's iteration (0)"
        loader.close()


def _reshard(rank: int, world: int, tmp: str) -> None:
    import fastckpt_accelerate

    acc, model, opt = _accelerator(f"{tmp}/p3", seed=3)
    loader = fastckpt_accelerate.enable(acc, {"root": f"{tmp}/p3/checkpoints"})
    acc.load_state(f"{tmp}/fast")
    _assert_equal(_full(model, opt), torch.load(f"{tmp}/expected.pt"), "2-process checkpoint on 1 process")
    # automatic naming: checkpoint_{iteration} under the root (the load moved iteration past 0); load_state()
    # with no folder takes the newest
    acc.project_configuration.automatic_checkpoint_naming = True
    assert acc.save_state() == f"{tmp}/p3/checkpoints/checkpoint_1"
    _step(acc, model, opt, 4)
    at_second = _full(model, opt)
    assert acc.save_state() == f"{tmp}/p3/checkpoints/checkpoint_2"
    _step(acc, model, opt, 5)
    acc.load_state()
    _assert_equal(_full(model, opt), at_second, "load_state() of the newest automatic checkpoint")
    loader.close()


def test_fsdp2_save_state_through_fastckpt_matches_stock_and_reshards(tmp_path: Path) -> None:
    run_ranks(_save_and_load, 2, str(tmp_path))
    run_ranks(_reshard, 1, str(tmp_path))
