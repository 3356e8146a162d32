"""FSDP checks of the GPU command: FSDP2 state saved through fastckpt, resharded on load, against the stock save.

``python -m benchmarks.gpu_fsdp --out DIR [--dry-run]`` writes ``DIR/fsdp.json``, one entry per check with
``status`` (passed / failed / skipped / refused) and a reason. World size 1 on a 1-device mesh (NCCL on a GPU,
gloo on the CPU). Checks: ``core_fsdp2`` (``fully_shard`` model + AdamW saved by a distributed ``Checkpointer``
and by DCP, each loaded into a freshly sharded model with ``load_into`` / ``dcp.load``, compared bit for bit);
``lightning_fsdp`` (``FastFSDPStrategy(state_dict_type="sharded")``: FSDP1 needs an accelerator, so on the CPU it
is skipped with that reason) and ``accelerate_fsdp2`` (``fsdp_version=2``, ``SHARDED_STATE_DICT`` with
``fastckpt_accelerate.enable``; on the CPU Accelerate's GPU-only FSDP gate is set by hand, recorded as
``fsdp_gate``): each saves through fastckpt and with the framework's stock sharded save, loads both into fresh
sharded models, and compares them bit for bit with the state at save.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn


def _model(dev: torch.device, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).to(dev)


def _full(t: Any) -> Any:
    """A plain CPU copy of a (DTensor) leaf, for the comparison."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t


def _flat(prefix: str, tree: Any, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            _flat(f"{prefix}/{k}", v, out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _flat(f"{prefix}/{i}", v, out)
    else:
        out[prefix] = _full(tree)
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ (tensors bit for bit), at most 5."""
    bad = [k for k in a if k not in b or (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]) is False]
    return (bad + [k for k in b if k not in a])[:5]


def core_fsdp2(dev: torch.device, work: Path) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from fastckpt import CheckpointConfig, Checkpointer

    def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        m = fully_shard(_model(dev, seed))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    model, opt = sharded(0)
    for _ in range(2):
        model(torch.randn(4, 32, device=dev)).sum().backward()
        opt.step()
        opt.zero_grad()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    at_save = _flat("", state, {})
    with Checkpointer(CheckpointConfig(root=str(work / "fast")), distributed=True) as ck:
        ck.watch(opt)
        ck.save(state, step=1).wait()
    dcp.save(state, checkpoint_id=str(work / "stock"))
    # reshard on load: fresh sharded targets (another init), filled by each method in place
    m2, o2 = sharded(1)
    m2(torch.randn(4, 32, device=dev)).sum().backward()
    o2.step()  # the optimizer state exists, as after a resume's first step
    fast_t = {"model": m2.state_dict(), "optim": o2.state_dict()}
    with Checkpointer(CheckpointConfig(root=str(work / "fast")), distributed=True) as ck:
        ck.load_into(fast_t, step=1)
    fast = _flat("", fast_t, {})
    m3, o3 = sharded(2)
    m3(torch.randn(4, 32, device=dev)).sum().backward()
    o3.step()
    stock_t = {"model": m3.state_dict(), "optim": o3.state_dict()}
    dcp.load(stock_t, checkpoint_id=str(work / "stock"))
    stock = _flat("", stock_t, {})
    bad = {"fastckpt vs state at save": _same(at_save, fast), "stock vs state at save": _same(at_save, stock),
           "fastckpt vs stock": _same(stock, fast)}
    ok = not any(bad.values())
    return {"status": "passed" if ok else "failed", "tensors": len(at_save), "mismatched": bad}


def _live(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every tensor of a sharded model and its optimizer, gathered whole, keyed by path (FSDP1 or FSDP2, with or
    without a device mesh: full state dicts, not DTensors or ShardedTensors)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    full = StateDictOptions(full_state_dict=True)
    return _flat("", {"model": get_model_state_dict(model, options=full),
                      "optim": get_optimizer_state_dict(model, opt, options=full)}, {})


def _verdict(at_save: dict[str, Any], loaded: dict[str, dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """passed when every loaded state equals the state at save bit for bit."""
    bad = {f"{name} vs state at save": _same(at_save, state) for name, state in loaded.items()}
    ok = not any(bad.values())
    return {"status": "passed" if ok else "failed", "tensors": len(at_save), "mismatched": bad, **extra}


def lightning_fsdp(dev: torch.device, work: Path) -> dict[str, Any]:
    """``FastFSDPStrategy(state_dict_type="sharded")`` saves through fastckpt; stock FSDPStrategy's DCP save of the
    same state; each loaded by a fresh Trainer (fastckpt's folder, and stock's through FastFSDPStrategy's fallback
    and through stock), compared bit for bit with the state at save."""
    if dev.type != "cuda":
        return {"status": "skipped", "reason": "FSDP1 needs an accelerator: torch's FullyShardedDataParallel raises "
                "'FSDP needs a non-CPU accelerator device' on CPU (Lightning refuses FSDPStrategy there too)"}
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import FSDPStrategy

    from fastckpt_lightning import FastCheckpointIO, FastFSDPStrategy

    class M(LightningModule):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.net = _model(torch.device("cpu"), seed)
            self.at_start: dict[str, Any] = {}

        def on_train_start(self) -> None:  # after a resume's restore, before its first step
            self.at_start = _live(self.trainer.strategy.model, self.trainer.optimizers[0])

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 32)), batch_size=4)

    def trainer(strategy: Any, steps: int) -> Trainer:
        return Trainer(accelerator="cuda", devices=1, strategy=strategy, plugins=[FastCheckpointIO()],
                       max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                       default_root_dir=str(work))

    t = trainer(FastFSDPStrategy(state_dict_type="sharded"), 2)
    t.fit(M(0), data)
    at_save = _live(t.strategy.model, t.optimizers[0])
    t.save_checkpoint(str(work / "fast.ckpt"))
    # stock FSDPStrategy's own sharded save (DCP) of the same state
    FSDPStrategy.save_checkpoint(t.strategy, t._checkpoint_connector.dump_checkpoint(), str(work / "stock.ckpt"))
    t.strategy.checkpoint_io.teardown()
    files = sorted(p.name for p in (work / "fast.ckpt").iterdir())
    if "manifest.json" not in files:
        return {"status": "failed", "files": files, "reason": "FastFSDPStrategy's save did not go through fastckpt"}
    loaded = {}
    for name, strategy, folder in (("fastckpt", FastFSDPStrategy(state_dict_type="sharded"), "fast.ckpt"),
                                   ("stock via FastFSDPStrategy", FastFSDPStrategy(state_dict_type="sharded"),
                                    "stock.ckpt"),
                                   ("stock", FSDPStrategy(state_dict_type="sharded"), "stock.ckpt")):
        module = M(7)
        resume = trainer(strategy, 3)
        resume.fit(module, data, ckpt_path=str(work / folder))
        if isinstance(resume.strategy.checkpoint_io, FastCheckpointIO):
            resume.strategy.checkpoint_io.teardown()
        loaded[name] = module.at_start
    note = ("world size 1: torch clamps FSDP1 to NO_SHARD, whose 'sharded' state dict is full plain tensors, so this "
            "checks the route through fastckpt, not DTensor blocks (those need 2 or more GPUs)"
            if t.world_size == 1 else "")
    return _verdict(at_save, loaded, files=files, note=note)


def _accelerator(dev: torch.device, seed: int) -> tuple[Any, nn.Module, torch.optim.Optimizer, bool]:
    """An FSDP2 Accelerator with a trained tiny model; ``forced`` when Accelerate's GPU-only gate was set by hand."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(fsdp_plugin=plugin)
    forced = acc.distributed_type != DistributedType.FSDP
    if forced:  # CPU (or one process that Accelerate did not take as distributed): set what the gate decides
        acc.state.distributed_type, acc.state.fsdp_plugin = DistributedType.FSDP, plugin
    model = _model(torch.device("cpu"), seed)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    if forced:
        acc.state.distributed_type = DistributedType.FSDP  # prepare() re-derives it from the device
    acc.backward(model(torch.randn(4, 32, device=acc.device)).sum())
    opt.step()
    opt.zero_grad()
    return acc, model, opt, forced


def accelerate_fsdp2(dev: torch.device, work: Path) -> dict[str, Any]:
    """``fsdp_version=2``, ``SHARDED_STATE_DICT`` with ``fastckpt_accelerate.enable``: ``save_state`` through
    fastckpt and stock's DCP ``save_state`` of the same state, each loaded by a fresh enabled Accelerator."""
    import fastckpt_accelerate

    acc, model, opt, forced = _accelerator(dev, 0)
    fast = fastckpt_accelerate.enable(acc, {"root": str(work / "root")})
    at_save = _live(model, opt)
    fast_dir = acc.save_state(str(work / "fast"))
    type(acc).save_state(acc, str(work / "stock"))  # stock Accelerate's FSDP2 save (DCP)
    acc.wait_for_everyone()
    fast.close()
    files = sorted(os.listdir(fast_dir))
    loaded = {}
    for name, folder, seed in (("fastckpt", "fast", 1), ("stock via enable()", "stock", 2)):
        acc2, model2, opt2, _ = _accelerator(dev, seed)
        loader = fastckpt_accelerate.enable(acc2, {"root": str(work / f"root{seed}")})
        acc2.load_state(str(work / folder))
        loaded[name] = _live(model2, opt2)
        loader.close()
    gate = "set by hand (Accelerate makes FSDP only on GPU-like devices)" if forced else "Accelerate's own"
    return _verdict(at_save, loaded, files=files, fsdp_gate=gate)


CHECKS: dict[str, Callable[[torch.device, Path], dict[str, Any]]] = {
    "core_fsdp2": core_fsdp2, "lightning_fsdp": lightning_fsdp, "accelerate_fsdp2": accelerate_fsdp2,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="on the CPU with gloo (the Lightning check skipped)")
    a = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not a.dry_run
    dev = torch.device("cuda:0" if gpu else "cpu")
    with socket.socket() as s:  # a free port for the one-process group's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if gpu:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if gpu else "CPU (dry run, gloo)"}
    with tempfile.TemporaryDirectory() as tmp:
        for name, check in CHECKS.items():
            try:  # each check on its own: one failing leaves the others' results
                results[name] = check(dev, Path(tmp) / name)
            except Exception:
                results[name] = {"status": "failed", "reason": traceback.format_exc()}
            print(name, json.dumps(results[name])[:300], flush=True)
    dist.destroy_process_group()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fsdp.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["status"] != "failed" for k, r in results.items() if k != "device") else 1


if __name__ == "__main__":
    raise SystemExit(main())
