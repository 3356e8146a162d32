"""FSDP checks of the GPU command: FSDP2 state saved through fastckpt, resharded on load, against the stock save.

``python -m benchmarks.gpu_fsdp --out DIR [--dry-run]`` writes ``DIR/fsdp.json``, one entry per check with
``status`` (passed / failed / skipped / refused) and a reason. World size 1 on a 1-device mesh (NCCL on a GPU,
gloo on the CPU). Checks: ``core_fsdp2`` (``fully_shard`` model + AdamW saved by a distributed ``Checkpointer``
and by DCP, each loaded into a freshly sharded model with ``load_into`` / ``dcp.load``, compared bit for bit);
``lightning_fsdp`` (Lightning ``FSDPStrategy(state_dict_type="sharded")`` with ``FastCheckpointIO``) and
``accelerate_fsdp2`` (``fsdp_version=2``, ``SHARDED_STATE_DICT`` with ``fastckpt_accelerate.enable``), which
the frameworks run only on a GPU: on the CPU they are skipped with that reason.
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


def lightning_fsdp(dev: torch.device, work: Path) -> dict[str, Any]:
    if dev.type != "cuda":
        return {"status": "skipped", "reason": "Lightning's FSDPStrategy refuses the CPU accelerator (needs CUDA)"}
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.strategies import FSDPStrategy

    from fastckpt_lightning import FastCheckpointIO

    class M(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(torch.device("cpu"))

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.net(batch[0]).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 32)), batch_size=4)
    t = Trainer(accelerator="cuda", devices=1, strategy=FSDPStrategy(state_dict_type="sharded"),
                plugins=[FastCheckpointIO()], max_steps=2, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, default_root_dir=str(work))
    t.fit(M(), data)
    t.save_checkpoint(str(work / "l.ckpt"))
    t.strategy.checkpoint_io.teardown()
    files = sorted(p.name for p in (work / "l.ckpt").iterdir()) if (work / "l.ckpt").is_dir() else ["l.ckpt"]
    through = any(n == "manifest.json" for n in files)
    return {"status": "passed" if through else "refused", "files": files,
            "reason": "" if through else "FSDPStrategy's sharded save bypasses CheckpointIO (DCP wrote it); "
            "use FastModelParallelStrategy for FSDP2 (docs/lightning.md)"}


def accelerate_fsdp2(dev: torch.device, work: Path) -> dict[str, Any]:
    if dev.type != "cuda":
        return {"status": "skipped", "reason": "Accelerate 1.15 makes an fsdp_plugin DistributedType.FSDP only on GPU-like devices"}
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    import fastckpt_accelerate
    from fastckpt.errors import ConfigError

    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"))
    try:
        fastckpt_accelerate.enable(acc, {"root": str(work / "acc")})
    except ConfigError as e:
        return {"status": "refused", "reason": f"fastckpt_accelerate.enable: {e}"}
    return {"status": "failed", "reason": "enable() accepted FSDP2 but this check has no save/compare for it yet"}


CHECKS: dict[str, Callable[[torch.device, Path], dict[str, Any]]] = {
    "core_fsdp2": core_fsdp2, "lightning_fsdp": lightning_fsdp, "accelerate_fsdp2": accelerate_fsdp2,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="on the CPU with gloo (framework checks skipped)")
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
