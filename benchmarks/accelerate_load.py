"""Accelerate resume (issue 13): ``accelerator.load_state`` of the workload model + AdamW, cold and warm.

Two folders of the same training state (GPT-2-small-shaped model after one fused AdamW step, ~1.5 GB):
one written by stock ``Accelerator.save_state``, one by ``fastckpt_accelerate`` (the native format: the same
stock files plus ``manifest.json``). Each load runs in a fresh process, as a resume does: it builds the model
and optimizer (no optimizer state yet), ``prepare``s them, and times ``load_state`` of its folder, then the
first training step after it (a mapped load defers page copies to the first writes: they are counted there).
Configurations alternate run by run, cold (the folder's pages dropped from the page cache) and warm, and the
restored model and optimizer state are checked against fingerprints taken at save time.

    python -m benchmarks.accelerate_load --workdir /tmp/accel-load --reps 5 [--code DIR ...]

``--code`` runs the fastckpt configuration with another checkout first on ``PYTHONPATH`` as well (the code
before a change), labelled by its directory name.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import REPO, repo_env
from . import workload as wl
from .measure import drop_cache, reset_hwm, rss, vm_hwm, warm_cache

__all__ = ["main"]

_CODE = "FASTCKPT_BENCH_CODE"  # the checkout a child imports fastckpt_accelerate from (empty: this one)


def _accelerator(project_dir: Path) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    return Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(project_dir)))


def _fingerprint(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    """Per-tensor float64 sums of the weights and AdamW's state: cheap, and any wrong tensor shows."""
    sums = [float(t.double().sum()) for t in model.state_dict().values()]
    for state in opt.state_dict()["state"].values():
        sums += [float(v.double().sum()) for _, v in sorted(state.items())]
    return sums


def prepare(workdir: Path) -> None:
    """Train one step, then save the same state with stock Accelerate and with fastckpt_accelerate."""
    import fastckpt_accelerate

    wl.setup_threads()
    acc = _accelerator(workdir / "proj")
    model, opt = wl.build(wl.FULL)
    model, opt = acc.prepare(model, opt)
    wl.train_step(model, opt, wl.Batches(wl.FULL))
    type(acc).save_state(acc, str(workdir / "stock"))  # Accelerate's own writer
    fast = fastckpt_accelerate.enable(acc, {"root": str(workdir / "fc")})
    acc.save_state(str(workdir / "fc" / "checkpoint_0"))
    fast.close()
    (workdir / "fingerprint.json").write_text(json.dumps(_fingerprint(acc.unwrap_model(model), opt)))


def load_once(workdir: Path, config: str) -> dict[str, Any]:
    """One resume in this (fresh) process: the load_state wall time, then the first step's."""
    wl.setup_threads()
    acc = _accelerator(workdir / "proj")
    model, opt = wl.build(wl.FULL, seed=1)  # not the saved weights
    model, opt = acc.prepare(model, opt)
    folder = workdir / ("stock" if config == "stock" else "fc/checkpoint_0")
    fast = None
    if config != "stock":
        import fastckpt_accelerate

        fast = fastckpt_accelerate.enable(acc, {"root": str(workdir / "fc")})
    gc.collect()
    before = rss()
    hwm = reset_hwm()
    t0 = time.perf_counter()
    acc.load_state(str(folder))
    load_s = time.perf_counter() - t0
    peak = vm_hwm() if hwm else None
    peak_gb = None if peak is None else (peak - before) / 1e9  # above what the process held before the load
    after_gb = (rss() - before) / 1e9
    got = _fingerprint(acc.unwrap_model(model), opt)
    exact = got == json.loads((workdir / "fingerprint.json").read_text())
    batches = wl.Batches(wl.FULL)
    t0 = time.perf_counter()
    wl.train_step(model, opt, batches)
    first_step_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    wl.train_step(model, opt, batches)
    second_step_s = time.perf_counter() - t0
    stats = getattr(fast, "last_load_stats", None) if fast is not None else None
    if fast is not None:
        fast.close()
    import fastckpt_accelerate as fa

    return {"config": config, "load_s": load_s, "first_step_s": first_step_s, "second_step_s": second_step_s,
            "resume_s": load_s + first_step_s, "peak_gb": peak_gb, "after_gb": after_gb, "exact": exact, "files": getattr(stats, "files", None),
            "code": os.path.dirname(os.path.dirname(fa.__file__))}


def _run_child(workdir: Path, config: str, code: str | None) -> dict[str, Any]:
    env = repo_env(OMP_NUM_THREADS="1", **{_CODE: code or ""})
    out = subprocess.run([sys.executable, "-m", "benchmarks.accelerate_load", "--workdir", str(workdir),
                          "--child", config], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--code", action="append", default=[], help="another checkout to measure as well")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help="write every run and the medians as JSON here")
    args = ap.parse_args(argv)
    if args.child:
        if os.environ.get(_CODE):  # `python -m` put this checkout first on sys.path: the other one goes before it
            assert not any(m.split(".")[0].startswith("fastckpt") for m in sys.modules), "fastckpt imported early"
            sys.path.insert(0, os.environ[_CODE])
        print(json.dumps(load_once(args.workdir, args.child)))
        return
    if not (args.workdir / "fingerprint.json").exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        prepare(args.workdir)
    configs: list[tuple[str, str | None]] = [("stock", None), ("fastckpt", None)]
    configs += [(f"fastckpt@{Path(c).name}", c) for c in args.code]
    runs: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for cold in (True, False):
            order = configs if rep % 2 == 0 else configs[::-1]  # alternate: drift hits every config alike
            for label, code in order:
                folder = args.workdir / ("stock" if label == "stock" else "fc")
                (drop_cache if cold else warm_cache)(folder)
                result = _run_child(args.workdir, "stock" if label == "stock" else "fastckpt", code)
                result.update(label=label, cold=cold, rep=rep)
                runs.append(result)
                print(json.dumps(result), flush=True)
    summary = {}
    for label, _ in configs:
        for cold in (True, False):
            xs = [r for r in runs if r["label"] == label and r["cold"] == cold]
            key = f"{label} {'cold' if cold else 'warm'}"
            summary[key] = {m: {"median": statistics.median(r[m] for r in xs), "min": min(r[m] for r in xs),
                                "max": max(r[m] for r in xs)} for m in ("load_s", "first_step_s", "resume_s", "peak_gb", "after_gb")
                                if all(r[m] is not None for r in xs)}
            summary[key]["exact"] = all(r["exact"] for r in xs)
            print(key, json.dumps(summary[key]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
