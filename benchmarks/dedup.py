"""Bytes sent over the network per checkpoint: fastckpt's remote tier with dedup (unchanged ranges copied
server-side, ``remote.dedup``), without it (every file sent whole, as before), DCP and stock Accelerate.

Two training states of a GPT-2 built from a ``GPT2Config`` (no download): a peft LoRA fine-tune (only the adapters
and their optimizer state change) and a full fine-tune with frozen embeddings. fastckpt uploads to SeaweedFS on
loopback through a TCP proxy that counts every byte the client sends (HTTP headers included). DCP
(``torch.distributed.checkpoint.save``) and Accelerate (``save_state``) write a local folder; what uploading it
as-is sends is the size of its files (neither has a way to send less), counted from disk. The LoRA case also goes
through the integrations straight to ``s3://`` (Accelerate ``save_state``, Lightning ``.ckpt``:
``dedup_integrations.py``). Reproduce:

    python -m benchmarks.dedup [--saves 3] [--layers 6]    # or: python -m benchmarks.run --only dedup
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import xxhash

from . import REPO
from .dedup_integrations import integration_markdown, measure_integrations

MiB = 1 << 20
PART = 5 * MiB  # S3's smallest part: the slack one changed region may cost


class _Count:
    """The client->server bytes through the proxy."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.up = 0

    def __call__(self, data: bytes, upload: bool) -> bytes:
        if upload:
            with self.lock:
                self.up += len(data)
        return data


def _model(case: str, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=768, n_layer=layers, n_head=12))
    if case == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True))
    else:  # frozen embeddings: token and position embeddings (the token one is tied to lm_head), rest trained
        for p in (model.transformer.wte.weight, model.transformer.wpe.weight):
            p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 50257, (2, 32), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _tensors(node: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(node, torch.Tensor):
        return [(prefix, node)]
    if isinstance(node, dict):
        return [t for k, v in node.items() for t in _tensors(v, f"{prefix}/{k}")]
    if isinstance(node, (list, tuple)):
        return [t for i, v in enumerate(node) for t in _tensors(v, f"{prefix}/{i}")]
    return []


def _digests(state: dict[str, Any]) -> list[tuple[str, int, str]]:
    return [(k, t.numel() * t.element_size(),
             xxhash.xxh3_128_hexdigest(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))
            for k, t in _tensors(state)]


def _changed(prev: list[tuple[str, int, str]], cur: list[tuple[str, int, str]]) -> tuple[int, int]:
    """(bytes of the tensors whose bytes changed, runs of consecutive changed tensors in state order)."""
    old = {k: d for k, _, d in prev}
    flags = [(n, old.get(k) != d) for k, n, d in cur]
    regions = sum(1 for i, (_, c) in enumerate(flags) if c and (i == 0 or not flags[i - 1][1]))
    return sum(n for n, c in flags if c), regions


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _fastckpt(case: str, layers: int, saves: int, work: Path, proxy: Any, count: _Count, server: Any,
              dedup: bool) -> dict[str, Any]:
    from fastckpt import CheckpointConfig, Checkpointer

    from tests.s3server import s3_storage_options

    model, opt = _model(case, layers)
    url = server.fresh_url(f"dedup-{case}-{'on' if dedup else 'off'}")
    ck = Checkpointer(CheckpointConfig(
        root=str(work / f"fc-{case}-{dedup}"), staging={"mode": "eager"}, health={"enabled": False},
        remote={"url": url, "storage_options": s3_storage_options(proxy.endpoint_url), "dedup": dedup}))
    rows, prev = [], None
    try:
        for step in range(1, saves + 1):
            _train(model, opt, step)
            state = _state(model, opt)
            digests = _digests(state)
            count.up = 0
            before = ck.upload_checksums.dedup.copied if ck.upload_checksums else 0
            t0 = time.perf_counter()
            ck.save(state, step=step)
            ck.wait()
            info = [i for i in ck.list() if i.step == step][0]
            changed, regions = _changed(prev, digests) if prev else (info.nbytes, 1)
            shards = len(list((work / f"fc-{case}-{dedup}" / info.name).glob("shard-*")))
            rows.append({"step": step, "size": info.nbytes, "sent_wire": count.up, "seconds": time.perf_counter() - t0,
                         "copied": ck.upload_checksums.dedup.copied - before, "changed": changed,
                         "regions": regions, "shards": shards,
                         "bound": changed + (regions + shards) * PART + 64 * 1024})
            prev = digests
        stats = ck.upload_checksums.dedup
        extra = {"fell_back": stats.fell_back, "unverified_copies": stats.unverified_copies}
    finally:
        ck.close()
    return {"rows": rows, **extra}


def _local_peer(case: str, layers: int, saves: int, work: Path, save: Callable[..., None], name: str) -> dict:
    model, opt = _model(case, layers)
    rows = []
    for step in range(1, saves + 1):
        _train(model, opt, step)
        out = work / f"{name}-{case}-{step}"
        save(model, opt, out)
        rows.append({"step": step, "size": _folder_bytes(out)})
        shutil.rmtree(out, ignore_errors=True)
    return {"rows": rows}


def _dcp_save(model: torch.nn.Module, opt: torch.optim.Optimizer, out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, opt), checkpoint_id=str(out))


def _accelerate_save(model: torch.nn.Module, opt: torch.optim.Optimizer, out: Path) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    m, o = acc.prepare(model, opt)
    acc.save_state(str(out))


def run_dedup(workdir: Path, saves: int = 3, layers: int = 6) -> dict[str, Any]:
    """Every peer on both cases; each figure per checkpoint."""
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
        from tests.faultproxy import FaultProxy
        from tests.s3server import start_s3_server
    except ImportError as e:
        return {"ok": False, "error": f"needs peft, transformers and tests/ (pip install -e '.[bench-dedup]'): {e}"}
    work = Path(tempfile.mkdtemp(prefix="dedup-", dir=workdir))
    server = start_s3_server(work / "weed")
    out: dict[str, Any] = {"ok": True, "saves": saves, "layers": layers, "cases": {}}
    try:
        with FaultProxy(("127.0.0.1", server.port), name="bench-count") as proxy:
            count = _Count()
            proxy.rewrite = count
            for case in ("lora", "frozen_embeddings"):
                res = out["cases"][case] = {}
                for dedup in (True, False):
                    res["fastckpt_dedup" if dedup else "fastckpt_full"] = _fastckpt(
                        case, layers, saves, work, proxy, count, server, dedup)
                res["dcp"] = _local_peer(case, layers, saves, work, _dcp_save, "dcp")
                res["accelerate"] = _local_peer(case, layers, saves, work, _accelerate_save, "acc")
            out["integrations"] = measure_integrations(lambda: _model("lora", layers), _train, _changed, _digests,
                                                       count, server, proxy.endpoint_url, saves, PART, work)
        from .dedup_local import measure

        out["local"] = measure(work)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return out


def dedup_markdown(res: dict[str, Any]) -> list[str]:
    """The report's section: bytes per checkpoint after the first, per peer and case."""
    from .labels import own_run_label

    md = ["## Bytes sent per checkpoint: dedup (issue 26, item 2)", ""] + own_run_label(res.get("meta"))
    if not res.get("ok"):
        return md + [f"n/a: {res.get('error')}", ""]
    md += [f"GPT-2 from a `GPT2Config` (n_embd 768, {res['layers']} layers, 12 heads), AdamW, one training step "
           f"between saves, {res['saves']} saves; the figure is the median over the saves after the first (the "
           "first always sends everything). fastckpt: the remote tier to SeaweedFS on loopback, bytes counted on "
           "the wire by a TCP proxy (HTTP headers, meta file and manifest included). DCP and Accelerate: the size "
           "of the folder they write, which is what uploading it sends (neither can send less). 'changed' = the "
           "tensors whose bytes differ from the previous save; 'bound' = changed + one 5 MiB part per changed "
           "region and per shard file (its header changes) + 64 KiB.", "",
           "| case | checkpoint size | fastckpt, dedup (sent) | fastckpt, dedup off (sent) | DCP (folder) | "
           "stock Accelerate `save_state` (folder) | changed | bound | within bound |",
           "|---|---|---|---|---|---|---|---|---|"]

    def med(rows: list[dict], key: str) -> float:
        vals = sorted(r[key] for r in rows[1:]) or [rows[0][key]]
        return vals[len(vals) // 2]

    for case, r in res["cases"].items():
        d, f = r["fastckpt_dedup"]["rows"], r["fastckpt_full"]["rows"]
        within = all(x["sent_wire"] <= x["bound"] for x in d[1:])
        md.append(f"| {case.replace('_', ' ')} | {med(d, 'size') / 1e6:.1f} MB | **{med(d, 'sent_wire') / 1e6:.2f} MB** | "
                  f"{med(f, 'sent_wire') / 1e6:.1f} MB | {med(r['dcp']['rows'], 'size') / 1e6:.1f} MB | "
                  f"{med(r['accelerate']['rows'], 'size') / 1e6:.1f} MB | {med(d, 'changed') / 1e6:.2f} MB | "
                  f"{med(d, 'bound') / 1e6:.1f} MB | {'yes' if within else 'NO'} |")
    md += ["", "Copied parts: every one checked against the CRC32C of the local bytes it stands for (SeaweedFS "
           "returns each copied part's CRC32C); copies that fell back to sending: "
           + ", ".join(f"{c} {r['fastckpt_dedup']['fell_back']} B" for c, r in res["cases"].items()) + ".",
           "Reproduce: `python -m benchmarks.dedup` (or `python -m benchmarks.run --only dedup --merge-into "
           "benchmarks/results.json`).", ""]
    from .dedup_local import local_markdown

    return md + integration_markdown(res.get("integrations")) + local_markdown(res.get("local"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dedup", description=__doc__.split("\n")[0])
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--workdir", default=str(REPO / "bench_out"))
    ap.add_argument("--json", default=None, help="write the raw results here")
    args = ap.parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    res = run_dedup(Path(args.workdir), args.saves, args.layers)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    print("\n".join(dedup_markdown(res)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
