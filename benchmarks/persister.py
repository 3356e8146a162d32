"""The persister process against the thread path: ``python -m benchmarks.persister [--reps N] [--shapes a,b]``.

Runs the plain loop's measure (``measure.task_core``: interleaved clean and checkpointed windows, the stall per
checkpoint from paired windows) for ``fastckpt-shm`` (shared-memory staging, this process's threads) and
``fastckpt-persister`` (the same staging, written and committed by the persister process), each run in a fresh
worker process, the peers alternating so that drift on a shared machine hits both alike. Prints one line per run
and a summary: the median over runs of each run's stall, the spread of those medians (the noise between runs), the
save() block and the flush (time to durable after the window).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from . import workload as wl

REPO = Path(__file__).resolve().parent.parent
SHAPES = {
    "tiny": wl.QUICK,  # ~1 MB of state
    "busy": wl.BUSY,  # ~60 MB
    "mid": wl.Shape(vocab=16384, d_model=512, heads=8, ffn=2048, layers=6, batch=1, seq=16),  # ~330 MB
}
PEERS = ("fastckpt-shm", "fastckpt-persister")


def one(peer: str, shape: str, every: int, n_ckpt: int, workdir: str) -> dict:
    args = {"peer": peer, "shape": SHAPES[shape].to_dict(), "root": os.path.join(workdir, "root"), "warmup": 3,
            "every": every, "n_ckpt": n_ckpt, "base_steps": 4}
    out = os.path.join(workdir, "out.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "benchmarks.worker", "core", json.dumps(args), out], check=True, env=env,
                   cwd=REPO, timeout=900)
    with open(out) as f:
        res = json.load(f)
    if not res["ok"]:
        raise RuntimeError(res["error"])
    from .measure import paired_stall

    r = res["result"]
    stall = paired_stall(r["ckpt_windows_s"], r["clean_windows_s"])
    return {"peer": peer, "shape": shape, "state_mb": r["state_bytes"] / 1e6, "stall_ms": stall["stall_s"] * 1e3,
            "noise_ms": stall["noise_s"] * 1e3, "block_ms": r["save_block_median_s"] * 1e3,
            "flush_ms": r["flush_s"] * 1e3, "step_ms": r["base_step_mean_s"] * 1e3,
            "bit_exact": r["restore"].get("bit_exact")}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.persister", description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", default="tiny,busy,mid")
    ap.add_argument("--every", type=int, default=8, help="K: steps per window")
    ap.add_argument("--n-ckpt", type=int, default=4)
    ap.add_argument("--json", default=None, help="write every run's figures here")
    a = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fastckpt-persister-bench-") as workdir:
        for shape in a.shapes.split(","):
            for rep in range(a.reps):
                for peer in (PEERS if rep % 2 == 0 else PEERS[::-1]):
                    r = one(peer, shape, a.every, a.n_ckpt, workdir)
                    runs.append(r)
                    print(json.dumps(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    print(f"\n{'shape':6} {'peer':20} {'state MB':>8} {'stall ms (median of runs)':>26} {'runs':>30} "
          f"{'block ms':>8} {'flush ms':>8} {'step ms':>7}")
    for shape in a.shapes.split(","):
        for peer in PEERS:
            rs = [r for r in runs if r["shape"] == shape and r["peer"] == peer]
            stalls = [r["stall_ms"] for r in rs]
            block, flush, step = (statistics.median(r[k] for r in rs) for k in ("block_ms", "flush_ms", "step_ms"))
            print(f"{shape:6} {peer:20} {rs[0]['state_mb']:8.1f} {statistics.median(stalls):26.1f} "
                  f"{' '.join(f'{s:.0f}' for s in stalls):>30} {block:8.1f} {flush:8.1f} {step:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
