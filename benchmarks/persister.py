"""fastckpt's variants against each other in turns: ``python -m benchmarks.persister [--peers a,b] [--reps N]
[--shapes a,b] [--neighbours N] [--quiet-too]``.

By default the persister process against the thread path: ``fastckpt-shm`` (shared-memory staging, this process's
threads) and ``fastckpt-persister`` (the same staging, written and committed by the persister process). ``--peers``
names any variants of benchmarks/peers.py (``fastckpt``, ``fastckpt-2pass``: the one pass against two passes, ...).

Runs the plain loop's measure (``measure.task_core``: interleaved clean and checkpointed windows, the stall per
checkpoint from paired windows) for each peer, each run in a fresh worker process, the peers alternating so that
drift on a shared machine hits them alike. ``--neighbours N`` runs the busy-host task instead (benchmarks/busy.py:
N CPU-bound processes pinned round robin beside the loop; 0 = two per CPU, as the harness), and ``--quiet-too``
runs each busy run's twin without them, right after it: the busy stall's reference. Prints one line per run and a
summary: the median over runs of each run's stall, the runs' stalls (the noise between runs), the save() block and
the flush (time to durable after the window).

Measured with it (2026-11-30, AMD EPYC VM, 2 CPUs): ``--peers fastckpt,fastckpt-2pass --shapes busy --every 10
--n-ckpt 12 --neighbours 0 --quiet-too --reps 4``, the busy stall of the one pass 28.5 ms (runs 51, 28, 27, 29)
against 32.1 ms (34, 34, 24, 30) in two passes, quiet 21.7 against 21.1: the one pass costs the busy host nothing.
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
from typing import Any

from . import REPO, repo_env
from . import workload as wl

SHAPES = {
    "tiny": wl.QUICK,  # ~1 MB of state
    "busy": wl.BUSY,  # ~60 MB
    "mid": wl.Shape(vocab=16384, d_model=512, heads=8, ffn=2048, layers=6, batch=1, seq=16),  # ~330 MB
}
PEERS = ("fastckpt-shm", "fastckpt-persister")


def one(peer: str, shape: str, every: int, n_ckpt: int, workdir: str, neighbours: int | None = None) -> dict:
    """One run of ``peer`` in a fresh worker process; ``neighbours`` not None: the busy-host task with that many
    (0: the harness's default, two per CPU; the quiet twin is ``neighbours=None`` on the plain task)."""
    args: dict[str, Any] = {"peer": peer, "shape": SHAPES[shape].to_dict(), "root": os.path.join(workdir, "root"),
                            "warmup": 3, "every": every, "n_ckpt": n_ckpt, "base_steps": 4}
    task = "core"
    if neighbours is not None:
        from .busy import default_neighbours

        task = "busy"
        args.update(durable_reps=3, n_neighbours=neighbours or default_neighbours(), limit_s=900.0, pin=True)
    out = os.path.join(workdir, "out.json")
    env = repo_env()
    subprocess.run([sys.executable, "-m", "benchmarks.worker", task, json.dumps(args), out], check=True, env=env,
                   cwd=REPO, timeout=900)
    with open(out) as f:
        res = json.load(f)
    if not res["ok"]:
        raise RuntimeError(res["error"])
    from .measure import paired_stall

    r = res["result"]
    stall = paired_stall(r["ckpt_windows_s"], r["clean_windows_s"])
    return {"peer": peer, "shape": shape, "busy": neighbours is not None, "state_mb": r["state_bytes"] / 1e6,
            "stall_ms": stall["stall_s"] * 1e3, "noise_ms": stall["noise_s"] * 1e3,
            "block_ms": r["save_block_median_s"] * 1e3, "flush_ms": r["flush_s"] * 1e3,
            "step_ms": r["base_step_mean_s"] * 1e3, "bit_exact": r["restore"].get("bit_exact")}


def summary(runs: list[dict], peers: tuple[str, ...], shapes: list[str]) -> str:
    """Per shape, peer and host (busy/quiet): the median over runs of the stall, each run's stall, and the medians of
    the save() block, the flush and the clean step."""
    lines = [f"{'shape':6} {'peer':20} {'host':5} {'state MB':>8} {'stall ms (median of runs)':>26} {'runs':>30} "
             f"{'block ms':>8} {'flush ms':>8} {'step ms':>7}"]
    for shape in shapes:
        for peer in peers:
            for busy in (True, False):
                rs = [r for r in runs if r["shape"] == shape and r["peer"] == peer and r["busy"] == busy]
                if not rs:
                    continue
                stalls = [r["stall_ms"] for r in rs]
                block, flush, step = (statistics.median(r[k] for r in rs) for k in ("block_ms", "flush_ms", "step_ms"))
                lines.append(f"{shape:6} {peer:20} {'busy' if busy else 'quiet':5} {rs[0]['state_mb']:8.1f} "
                             f"{statistics.median(stalls):26.1f} {' '.join(f'{s:.0f}' for s in stalls):>30} "
                             f"{block:8.1f} {flush:8.1f} {step:7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from . import peers as peer_table

    ap = argparse.ArgumentParser(prog="python -m benchmarks.persister", description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default=",".join(PEERS), help="comma list of benchmarks/peers.py names, in turns")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--shapes", default="tiny,busy,mid", help=f"comma list of {','.join(SHAPES)}")
    ap.add_argument("--every", type=int, default=8, help="K: steps per window")
    ap.add_argument("--n-ckpt", type=int, default=4)
    ap.add_argument("--neighbours", type=int, default=None,
                    help="the busy-host task with this many CPU-bound neighbours (0: two per CPU)")
    ap.add_argument("--quiet-too", action="store_true", help="with --neighbours: each run's twin without them")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    a = ap.parse_args(argv)
    peers = tuple(p for p in a.peers.split(",") if p)
    shapes = [s for s in a.shapes.split(",") if s]
    unknown = [p for p in peers if p not in peer_table.PEERS] + [s for s in shapes if s not in SHAPES]
    if unknown or not peers:
        ap.error(f"unknown peer or shape {unknown}: peers are {','.join(peer_table.PEERS)}; "
                 f"shapes {','.join(SHAPES)}")
    if a.neighbours is not None and a.neighbours < 0:
        ap.error(f"--neighbours must be 0 or more, got {a.neighbours}")
    if a.quiet_too and a.neighbours is None:
        ap.error("--quiet-too needs --neighbours (the quiet twin of a busy run)")
    runs = []
    with tempfile.TemporaryDirectory(prefix="fastckpt-variants-bench-") as workdir:
        for shape in shapes:
            for rep in range(a.reps):
                for peer in (peers if rep % 2 == 0 else peers[::-1]):
                    hosts = [a.neighbours] + ([None] if a.quiet_too else [])
                    for nb in hosts:
                        r = one(peer, shape, a.every, a.n_ckpt, workdir, nb)
                        runs.append(r)
                        print(json.dumps(r), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(runs, indent=1))
    print()
    print(summary(runs, peers, shapes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
