"""Where the background threads run (``persist.background_cpus``): the plain loop's stall per checkpoint, ``auto``
against ``all``, step by step.

``python -m benchmarks.placement [--runs 3] [--steps 61] [--write BENCHMARKS.md]``

The breakdown (``--only breakdown``) pairs whole windows of K steps, whose noise on the 2-core benchmark host is
+-100-450 ms a pair: too coarse for a difference of tens of ms in two runs. This measures each checkpoint by the
two steps it touches (the save and the next one: persisting takes ~1.2 s of a ~1.5 s step) against the two steps
before it, ``(t[k] + t[k+1]) - (t[k-2] + t[k-1])``, in the harness's workload (1.48 GB of state, one training
thread, glibc tuned as in every stall task), a save every ``EVERY`` steps, the settings in fresh processes in turns
(``--runs`` of each), and reports each setting's mean with its standard error and its median over all checkpoints.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

EVERY = 6
SETTINGS = ("all", "auto")
HEADING = "## Background thread placement"


def one(setting: str, steps: int, root: str) -> dict[str, Any]:
    """One run in this process: the stall estimate of every checkpoint, and where fastckpt's threads ran."""
    from fastckpt import CheckpointConfig, Checkpointer

    from . import workload as wl
    from .measure import Trainer

    wl.tune_malloc()
    tr = Trainer(wl.FULL)
    ck = Checkpointer(CheckpointConfig(root=root, retention={"keep_last": 2}, persist={"background_cpus": setting}))
    ck.watch(tr.opt)
    tr.step()
    ck.save(tr.state(0), 0)  # the staging buffers' first touch, outside the measured steps
    tr.step()
    ck.wait()
    tr.step()
    where = sorted({(t.name.rsplit("-", 1)[0], tuple(sorted(os.sched_getaffinity(t.native_id))))
                    for t in threading.enumerate() if t.name.startswith("fastckpt-") and t.native_id})
    times = []
    for k in range(steps):
        t0 = time.perf_counter()
        if k % EVERY == 0 and k > 0:
            ck.save(tr.state(k), k)
        tr.step()
        times.append(time.perf_counter() - t0)
    ck.close()
    stalls = [times[k] + times[k + 1] - times[k - 2] - times[k - 1] for k in range(EVERY, steps - 1, EVERY)]
    return {"setting": setting, "stalls_s": stalls, "step_s": statistics.median(times), "threads": where}


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for s in SETTINGS:
        xs = [x for r in runs if r["setting"] == s for x in r["stalls_s"]]
        if len(xs) > 1:
            out[s] = {"n": len(xs), "mean_s": statistics.mean(xs), "se_s": statistics.stdev(xs) / len(xs) ** 0.5,
                      "median_s": statistics.median(xs)}
    return out


def markdown(runs: list[dict[str, Any]], command: str, machine: str) -> str:
    got = summary(runs)
    lines = [HEADING, "", f"Reproduce: `{command}` ({machine}). Method: benchmarks/placement.py's docstring. "
             f"The plain loop, 1.48 GB of state, a save every {EVERY} steps, median step "
             f"{statistics.median(r['step_s'] for r in runs):.2f} s, {len(runs) // len(SETTINGS)} runs per setting "
             "in turns.", "", "| `persist.background_cpus` | checkpoints | stall per checkpoint, mean +- s.e. | median "
             "| where fastckpt's threads ran |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        if s in got:
            g = got[s]
            where = next((r["threads"] for r in runs if r["setting"] == s), [])
            lines.append(f"| `{s}` | {g['n']} | {g['mean_s'] * 1e3:.0f} +- {g['se_s'] * 1e3:.0f} ms | "
                         f"{g['median_s'] * 1e3:.0f} ms | {', '.join(f'{n}: {list(c)}' for n, c in where)} |")
    return "\n".join(lines + [""])


def _machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    return (f"{cpu}, {len(os.sched_getaffinity(0))} CPUs, load average at the end {os.getloadavg()[0]:.1f}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each setting, in turns")
    ap.add_argument("--steps", type=int, default=61, help="steps per run (a save every 6)")
    ap.add_argument("--write", default=None, help="merge the section into this report (e.g. BENCHMARKS.md)")
    ap.add_argument("--one", nargs=2, metavar=("SETTING", "ROOT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], args.steps, args.one[1])))
        return
    runs = []
    for r in range(args.runs):
        for s in SETTINGS:
            root = tempfile.mkdtemp(prefix="placement-", dir=os.environ.get("TMPDIR", "/tmp"))
            try:
                out = subprocess.run([sys.executable, "-m", "benchmarks.placement", "--steps", str(args.steps),
                                      "--one", s, root], capture_output=True, text=True, check=True)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"run {r + 1} {s}: {[round(x * 1e3) for x in runs[-1]['stalls_s']]} ms", flush=True)
    command = "python -m benchmarks.placement " + " ".join(argv if argv is not None else sys.argv[1:])
    md = markdown(runs, command.strip(), _machine())
    print(md)
    if args.write:
        from .gpu_report import merge

        report = Path(args.write)
        report.write_text(merge(report.read_text(), md, HEADING))
        Path(report.parent / "benchmarks" / "placement.json").write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
