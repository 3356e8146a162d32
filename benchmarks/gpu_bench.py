"""GPU benchmark: fastckpt vs DCP async_save (pinned DefaultStager) vs Lightning AsyncCheckpointIO vs Meta's
torch_checkpointing CheckpointManager, GPT-2 small.

``python -m benchmarks.gpu_bench --out DIR [--dry-run]``: a GPT-2-small-shaped model (untied head) + AdamW,
bf16 autocast over fp32 master weights, a checkpoint every 10 steps. For each peer: the stall per checkpoint
as a fraction of the step time, the device-to-host bandwidth achieved beside the pinned-memory peak measured
in the same run, and every restored checkpoint compared bit for bit with the state at save time. Without a
GPU (``--dry-run``) it runs tiny sizes on the CPU and labels every figure as a CPU fallback.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shape:
    vocab: int
    ctx: int
    layers: int
    dim: int
    heads: int
    batch: int


GPT2_SMALL = Shape(vocab=50257, ctx=1024, layers=12, dim=768, heads=12, batch=8)  # ~163M untied (124M tied)
TINY = Shape(vocab=512, ctx=32, layers=2, dim=64, heads=4, batch=2)


class Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.ln1, self.ln2 = nn.LayerNorm(s.dim), nn.LayerNorm(s.dim)
        self.qkv, self.proj = nn.Linear(s.dim, 3 * s.dim), nn.Linear(s.dim, s.dim)
        self.fc, self.out = nn.Linear(s.dim, 4 * s.dim), nn.Linear(4 * s.dim, s.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(s.vocab, s.dim), nn.Embedding(s.ctx, s.dim)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.ln, self.head = nn.LayerNorm(s.dim), nn.Linear(s.dim, s.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def flat_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The live tensors (no copies) under flat string keys, the one layout every peer saves."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim.{names[id(p)]}.{k}"] = v
    return out


def pinned_peak(dev: torch.device, nbytes: int) -> float:
    """Device-to-host GB/s into page-locked memory (plain memcpy on the CPU fallback)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    dst.copy_(src, non_blocking=True)
    sync(dev)
    reps, t0 = 5, time.perf_counter()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    sync(dev)
    return reps * nbytes / (time.perf_counter() - t0) / 1e9


class Peer:
    """One checkpointing method: save() inside the loop, before_step() before each optimizer step."""

    name = ""

    def __init__(self, root: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.root, self.model, self.opt = root, model, opt
        self.d2h_gbps: list[float] = []
        self.details: list[dict[str, Any]] = []  # per checkpoint, what the peer reports of itself

    def save(self, step: int) -> None: ...
    def before_step(self) -> None: ...
    def finish(self) -> None: ...
    def load(self, step: int) -> dict[str, torch.Tensor]: ...


class Fast(Peer):
    name = "fastckpt"
    overrides: dict[str, Any] = {}  # config sections a variant changes (fast_variant)

    def __init__(self, root: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(root, model, opt)
        from fastckpt import CheckpointConfig, Checkpointer

        self.ckpt = Checkpointer(CheckpointConfig(root=str(root), **self.overrides))
        self.ckpt.watch(opt)  # its step pre-hook is the stall before the next step
        # the buffers made and page-locked before the first save, as torch_checkpointing's prewarm_staging does
        self.ckpt.prewarm(flat_state(model, opt)).result()
        self.handles: list[Any] = []

    def save(self, step: int) -> None:
        self.handles.append(self.ckpt.save(flat_state(self.model, self.opt), step=step))

    def finish(self) -> None:
        for h in self.handles:
            h.wait()
            s = h.stats
            # where the stall went: host waits (pre-hook included) vs GPU-side waits vs the rest (contention)
            self.details.append({"blocking_ms": round(s.blocking_ms, 1), "staging_ms": round(s.staging_ms, 1),
                                 "waited_ms": round(s.waited_ms, 1), "gpu_waits": s.gpu_waits,
                                 "persist_s": round(s.persist_s, 3), "device_snapshot": s.device_snapshot})
            if s.staging_ms:  # an upper bound on the copy time, so a lower bound on the bandwidth
                self.d2h_gbps.append(s.nbytes / (s.staging_ms / 1e3) / 1e9)
        self.ckpt.close()

    def load(self, step: int) -> dict[str, torch.Tensor]:
        from fastckpt import CheckpointConfig, Checkpointer  # here: a broken import fails this peer only

        with Checkpointer(CheckpointConfig(root=str(self.root))) as c:  # a fresh reader, as after a restart
            return c.load(step=step)


class DCP(Peer):
    name = "dcp_async_save"

    def __init__(self, root: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(root, model, opt)
        import torch.distributed.checkpoint as dcp

        self.dcp, self.pending, self.futures = dcp, None, []
        try:
            from torch.distributed.checkpoint.staging import DefaultStager  # noqa: F401 - ImportError: older torch

            from .dcpstager import kept_stager

            gpu = torch.cuda.is_available()  # pinning and non-blocking copies need CUDA (refused otherwise)
            # pinned, staged on the stager's thread, no shared memory (the uploader is a thread, not a process);
            # by keyword: the positional order is (pinned, shared memory, async, non-blocking)
            # kept: torch 2.11's async_save closes the stager it is given after each upload (benchmarks/dcpstager.py)
            self.stager: Any = kept_stager(use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=True,
                                           use_non_blocking_copy=gpu)
            self.name = "dcp_async_save (pinned DefaultStager)" if gpu else "dcp_async_save (DefaultStager, CPU)"
        except ImportError:  # older torch: DCP's own default staging, said in the label
            self.stager = None
            self.name = "dcp_async_save (no DefaultStager in this torch)"

    def save(self, step: int) -> None:
        kw = {"async_stager": self.stager} if self.stager is not None else {}
        t0 = time.perf_counter()
        if self.futures:  # as torchtitan does: the stager reuses its cached host storages, which the previous
            self.futures[-1].result()  # checkpoint's upload may still be reading (else ckpt N holds N+1's values)
        try:
            r = self.dcp.async_save(flat_state(self.model, self.opt), checkpoint_id=str(self.root / str(step)), **kw)
        except Exception as e:  # noqa: BLE001 - a stager this torch refuses: DCP's own staging, said in the label
            if self.stager is None:
                raise
            self.stager.release()
            self.stager = None
            self.name = f"dcp_async_save (default staging: DefaultStager raised {type(e).__name__}: {e})"
            r = self.dcp.async_save(flat_state(self.model, self.opt), checkpoint_id=str(self.root / str(step)))
        staged = getattr(r, "staging_completion", None)
        nbytes = sum(v.nbytes for v in flat_state(self.model, self.opt).values())
        if staged is not None:  # timed when the copy completes, not when the loop next looks
            staged.add_done_callback(lambda _f: self.d2h_gbps.append(nbytes / (time.perf_counter() - t0) / 1e9))
        self.pending = (staged, t0, nbytes)
        self.futures.append(getattr(r, "upload_completion", r))

    def before_step(self) -> None:
        if self.pending is not None:  # the tensors may be written only once staged
            staged, t0, nbytes = self.pending
            if staged is not None:
                staged.result()
            else:  # staged inside async_save: the call's own time
                self.d2h_gbps.append(nbytes / (time.perf_counter() - t0) / 1e9)
            self.pending = None

    def finish(self) -> None:
        self.before_step()
        for f in self.futures:
            f.result()
        if self.stager is not None:
            self.stager.release()

    def load(self, step: int) -> dict[str, torch.Tensor]:
        tmpl = {k: torch.empty_like(v, device="cpu") for k, v in flat_state(self.model, self.opt).items()}
        self.dcp.load(tmpl, checkpoint_id=str(self.root / str(step)))
        return tmpl


class LightningAsync(Peer):
    name = "lightning AsyncCheckpointIO"

    def __init__(self, root: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(root, model, opt)
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        self.io = AsyncCheckpointIO(TorchCheckpointIO())

    def save(self, step: int) -> None:  # clones on the device inside the call, writes on its thread
        self.io.save_checkpoint(flat_state(self.model, self.opt), str(self.root / f"{step}.ckpt"))

    def finish(self) -> None:
        self.io.teardown()

    def load(self, step: int) -> dict[str, torch.Tensor]:
        return torch.load(self.root / f"{step}.ckpt", map_location="cpu", weights_only=True)


class TorchCheckpointing(Peer):
    """Meta's torch_checkpointing ``CheckpointManager`` (0.1.1) with its defaults (async save: staging on its
    thread, pinned on CUDA; a writer process), its staging prewarmed as its docs advise; local writes without
    O_DIRECT (its default writer's unaligned buffers fail on some file systems: EINVAL). Keys go under one item
    (its item names refuse dots)."""

    name = "torch_checkpointing CheckpointManager"

    def __init__(self, root: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(root, model, opt)
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self.mgr = CheckpointManager(CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
        self.mgr.prewarm_staging({"state": flat_state(model, opt)})
        self.write: Any = None

    def save(self, step: int) -> None:
        if self.write is not None:  # its staging buffers are reused: the previous write must be done
            self.write.result()
        self.write = self.mgr.save(str(self.root / str(step)), {"state": flat_state(self.model, self.opt)})

    def before_step(self) -> None:
        with self.mgr.lock():  # its documented guard of the optimizer step: waits while a capture runs
            pass

    def finish(self) -> None:
        if self.write is not None:
            self.write.result()
        self.mgr.close()

    def load(self, step: int) -> dict[str, torch.Tensor]:
        from torch_checkpointing import CheckpointManager

        into = {"state": {k: torch.zeros_like(v, device="cpu") for k, v in flat_state(self.model, self.opt).items()}}
        # a fresh one, as after a restart; it only loads, so with the synchronous saver: the default (asynchronous)
        # one spawns its writer process at construction, 3 s of a dry run's CPU for each load that never writes
        reader = CheckpointManager(CheckpointManager.Config.with_sync_save())
        try:
            return reader.load(str(self.root / str(step)), into=into)["state"]
        finally:
            reader.close()


PEERS: tuple[type[Peer], ...] = (Fast, DCP, LightningAsync, TorchCheckpointing)


def fast_variant(label: str, **overrides: Any) -> type[Peer]:
    """fastckpt with some config sections changed (``--variants``): which setting the stall comes from."""
    return type(f"Fast_{label}", (Fast,), {"name": f"fastckpt ({label})", "overrides": overrides})


VARIANTS: tuple[type[Peer], ...] = (
    # first: the command's time box may cut the later ones (staging.device_snapshot, engine/devicesnap.py)
    fast_variant("device snapshot", staging={"device_snapshot": "on"}),
    fast_variant("health off", health={"enabled": False}),
    fast_variant("persister process", persist={"process": "on"}, staging={"shm": True}),
    fast_variant("fsync off", persist={"fsync": False}),
)


def staging_probe(s: Shape, dev: torch.device, root: Path, n: int = 4) -> dict[str, Any]:
    """save() to ``wait_staged(host=True)`` on an idle GPU: the copy rate alone, first call (allocation and page
    locking included) apart from the later ones, which reuse the slot."""
    from fastckpt import CheckpointConfig, Checkpointer

    torch.manual_seed(0)
    model = GPT(s).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        opt.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    nbytes = sum(v.nbytes for v in flat_state(model, opt).values())
    times = []
    with Checkpointer(CheckpointConfig(root=str(root), persist={"fsync": False})) as ck:
        for i in range(n):
            sync(dev)
            t0 = time.perf_counter()
            h = ck.save(flat_state(model, opt), step=i)
            h.wait_staged(host=True)
            times.append(time.perf_counter() - t0)
            h.wait()
    return {"bytes": nbytes, "first_s": times[0], "later_s": times[1:],
            "later_gbps": nbytes / statistics.median(times[1:]) / 1e9}


def run_peer(cls: type[Peer], s: Shape, dev: torch.device, root: Path, every: int, n_ckpt: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(s).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, s.vocab, (s.batch, s.ctx + 1), device=dev)
    x, y = data[:, :-1], data[:, 1:]

    def step(peer: Peer | None) -> None:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        if peer is not None:
            peer.before_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)

    for _ in range(3):  # warm-up: the optimizer state exists before the first save
        step(None)
    times = []
    for _ in range(every):
        t0 = time.perf_counter()
        step(None)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    peer = cls(root, model, opt)
    refs: dict[int, dict[str, torch.Tensor]] = {}
    stalls, blocking, slow = [], [], []
    for c in range(n_ckpt):
        # the state at save time, copied before the timed window so the copy costs the peer nothing
        refs[c] = {k: v.detach().to("cpu", copy=True) for k, v in flat_state(model, opt).items()}
        sync(dev)
        t0 = time.perf_counter()
        peer.save(c)
        blocking.append(time.perf_counter() - t0)
        window = []
        for _ in range(every):
            t1 = time.perf_counter()
            step(peer)
            window.append(time.perf_counter() - t1)
        stalls.append(max(0.0, time.perf_counter() - t0 - every * step_s))
        slow.append([round((w - step_s) * 1e3, 1) for w in window])  # each step's excess over a plain step
    t0 = time.perf_counter()
    peer.finish()
    drain_s = time.perf_counter() - t0
    mismatched = []
    for c, ref in refs.items():
        got = peer.load(c)
        bad = [k for k, v in ref.items() if k not in got or not torch.equal(got[k].cpu(), v)]
        mismatched += [f"ckpt {c}: {k}" for k in bad[:5]]
    nbytes = sum(v.nbytes for v in refs[0].values())
    return {
        "peer": peer.name, "step_s": step_s, "stall_s": statistics.median(stalls),
        "stall_fraction_of_step": statistics.median(stalls) / step_s, "save_call_s": statistics.median(blocking),
        "drain_s": drain_s, "d2h_gbps": statistics.median(peer.d2h_gbps) if peer.d2h_gbps else None,
        "stalls_ms": [round(x * 1e3, 1) for x in stalls], "save_calls_ms": [round(x * 1e3, 1) for x in blocking],
        "details": peer.details, "step_excess_ms": slow,
        "state_bytes": nbytes, "checkpoints": n_ckpt, "bit_exact": not mismatched, "mismatched": mismatched,
    }


def device_label(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"CPU fallback, not a GPU measurement (torch {torch.__version__})"


def markdown(res: dict[str, Any]) -> str:
    lines = [
        "## GPU", "",
        f"Device: **{res['device']}**. Model: {res['params'] / 1e6:.2f}M parameters ({res['shape']}), AdamW, "
        f"bf16 autocast over fp32 master weights, a checkpoint every {res['every']} steps. Pinned-memory "
        f"device-to-host peak measured in the same run: {res['pinned_peak_gbps']:.1f} GB/s.", "",
        "Stall: the time the steps after a save took beyond plain steps; median over the checkpoints, the first "
        "(which allocates and page-locks the host buffers) shown apart.", "",
        "| method | step (ms) | stall / checkpoint (ms) | stall as fraction of a step | first checkpoint's stall (ms) "
        "| save() call (ms) | D2H achieved (GB/s) | restores bit-exact |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["peers"]:
        if "skipped" in r:
            lines.append(f"| {r['peer']} | {r['skipped']} | | | | | | |")
            continue
        if "error" in r:
            lines.append(f"| {r['peer']} | failed: {r['error'].splitlines()[-1]} | | | | | | |")
            continue
        bw = "n/a" if r["d2h_gbps"] is None else f"{r['d2h_gbps']:.1f}"
        first = f"{r['stalls_ms'][0]:.1f}" if r.get("stalls_ms") else "n/a"
        lines.append(f"| {r['peer']} | {r['step_s'] * 1e3:.1f} | {r['stall_s'] * 1e3:.1f} | "
                     f"{r['stall_fraction_of_step']:.2f} | {first} | {r['save_call_s'] * 1e3:.1f} | {bw} | "
                     f"{'yes' if r['bit_exact'] else 'NO'} |")
    probe = res.get("staging_probe")
    if probe and "later_gbps" in probe:
        lines += ["", f"fastckpt staging alone on an idle GPU (save() to wait_staged(host=True), "
                      f"{probe['bytes'] / 1e9:.2f} GB): first {probe['first_s'] * 1e3:.0f} ms (allocation and "
                      f"page-locking included), then {', '.join(f'{t * 1e3:.0f}' for t in probe['later_s'])} ms "
                      f"({probe['later_gbps']:.1f} GB/s)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes; on the CPU when there is no GPU")
    ap.add_argument("--work", type=Path, default=None, help="where the checkpoints go (default OUT/ckpts)")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--variants", action="store_true", help="also fastckpt with health off, a persister process, "
                    "fsync off, and an idle-GPU staging probe: where the stall comes from")
    ap.add_argument("--only", default=None, help="run only the peers whose name starts with this (e.g. fastckpt)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = TINY if a.dry_run or dev.type == "cpu" else GPT2_SMALL
    a.out.mkdir(parents=True, exist_ok=True)
    peak = pinned_peak(dev, (1 << 30) if dev.type == "cuda" else (16 << 20))
    res: dict[str, Any] = {
        "device": device_label(dev), "gpu": dev.type == "cuda", "shape": asdict(s), "every": a.every,
        "params": sum(p.numel() for p in GPT(s).parameters()), "pinned_peak_gbps": peak, "peers": [],
    }
    work = a.work if a.work is not None else a.out / "ckpts"
    if a.variants:
        try:
            res["staging_probe"] = staging_probe(s, dev, work / "probe")
        except Exception:
            res["staging_probe"] = {"error": traceback.format_exc()}
        shutil.rmtree(work / "probe", ignore_errors=True)
        print("staging_probe", json.dumps(res["staging_probe"], default=str)[:600], flush=True)
    for cls in PEERS + (VARIANTS if a.variants else ()):
        if a.only and not (cls.name or cls.__name__).startswith(a.only):
            continue
        try:  # one peer failing (an API absent from this torch) leaves the others measured
            res["peers"].append(run_peer(cls, s, dev, work / cls.__name__, a.every, a.checkpoints))
        except ImportError as e:  # an optional peer not installed here (benchmarks/gpu_wheels.sh brings it)
            res["peers"].append({"peer": cls.name or cls.__name__, "skipped": f"not installed ({e})"})
        except Exception:
            res["peers"].append({"peer": cls.name or cls.__name__, "error": traceback.format_exc()})
        shutil.rmtree(work / cls.__name__, ignore_errors=True)  # ~2 GB a checkpoint on the GPU: free the disk
        print(json.dumps(res["peers"][-1], default=str)[:400], flush=True)
        # after each peer: a run cut short by the command's time box still leaves the peers it measured
        (a.out / "gpu_bench.json").write_text(json.dumps(res, indent=1, default=str))
        (a.out / "gpu_bench.md").write_text(markdown(res))
    return 0 if all("skipped" in r or ("error" not in r and r["bit_exact"]) for r in res["peers"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
