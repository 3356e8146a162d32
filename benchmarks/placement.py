"""Where the background threads run (``persist.background_cpus``): the plain loop's stall per checkpoint, ``auto``
against ``all``, step by step.

``python -m benchmarks.placement [--runs 3] [--steps 61] [--write BENCHMARKS.md]``
``python -m benchmarks.placement --busy [--runs 8] [--write BENCHMARKS.md]``

The breakdown (``--only breakdown``) pairs whole windows of K steps, whose noise on the 2-core benchmark host is
+-100-450 ms a pair: too coarse for a difference of tens of ms in two runs. This measures each checkpoint by the
two steps it touches (the save and the next one: persisting takes ~1.2 s of a ~1.5 s step) against the two steps
before it, ``(t[k] + t[k+1]) - (t[k-2] + t[k-1])``, in the harness's workload (1.48 GB of state, one training
thread, glibc tuned as in every stall task), a save every ``EVERY`` steps, the settings in fresh processes in turns
(``--runs`` of each), and reports each setting's mean with its standard error and its median over all checkpoints.

``--busy``: the busy host's loop instead (benchmarks/busy.py: its model, two CPU-bound neighbours pinned to each CPU,
a checkpoint every 10 steps, 12 windows paired as in the harness), ``auto`` against ``last``: the background
threads held on the last CPU, as ``auto`` placed them before it followed the training thread's CPU at each save
(2026-11-30). Each run's own median is shown too: the spread between runs is the noise that counts here.
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
BUSY_SETTINGS = ("last", "auto")
BUSY_HEADING = "## Background thread placement, busy host"


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


def one_busy(setting: str, root: str) -> dict[str, Any]:
    """One run of the busy host's loop with the background threads placed by ``setting`` (``last``: a list of the
    last usable CPU), in this process."""
    from . import peers
    from . import workload as wl
    from .busy import task_busy

    value: Any = [max(os.sched_getaffinity(0))] if setting == "last" else setting
    peers.Fastckpt.config = {"persist": {"background_cpus": value}}
    out = task_busy("fastckpt", wl.BUSY.to_dict(), root, warmup=2, every=10, n_ckpt=12, base_steps=4, durable_reps=0,
                    n_neighbours=None, limit_s=600.0)
    return {"setting": setting, "stalls_s": out["stall_pairs_s"], "step_s": out["base_step_mean_s"],
            "threads": [("background_cpus", tuple(value) if isinstance(value, list) else (value,))]}


def summary(runs: list[dict[str, Any]], settings: tuple[str, ...] = SETTINGS) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for s in settings:
        xs = [x for r in runs if r["setting"] == s for x in r["stalls_s"]]
        if len(xs) > 1:
            out[s] = {"n": len(xs), "mean_s": statistics.mean(xs), "se_s": statistics.stdev(xs) / len(xs) ** 0.5,
                      "median_s": statistics.median(xs),
                      "run_medians_s": [statistics.median(r["stalls_s"]) for r in runs if r["setting"] == s]}
    return out


def busy_markdown(runs: list[dict[str, Any]], command: str, machine: str) -> str:
    got = summary(runs, BUSY_SETTINGS)
    lines = [BUSY_HEADING, "", f"Reproduce: `{command}` ({machine}). Method: benchmarks/placement.py's docstring. "
             "The busy host's loop (63.1 MB of state, a save every 10 steps, two CPU-bound neighbours pinned to each "
             f"CPU), median step {statistics.median(r['step_s'] for r in runs) * 1e3:.0f} ms, "
             f"{len(runs) // len(BUSY_SETTINGS)} runs per setting in turns. `last`: the background threads held on "
             "the last CPU (what `auto` did before it kept off the training thread's CPU at each save).", "",
             "| placement | checkpoints | stall per checkpoint, mean +- s.e. | median | each run's median |",
             "|---|---|---|---|---|"]
    for s in BUSY_SETTINGS:
        if s in got:
            g = got[s]
            lines.append(f"| `{s}` | {g['n']} | {g['mean_s'] * 1e3:.0f} +- {g['se_s'] * 1e3:.0f} ms | "
                         f"{g['median_s'] * 1e3:.0f} ms | {', '.join(f'{x * 1e3:.0f}' for x in g['run_medians_s'])} "
                         "ms |")
    return "\n".join(lines + [""])


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each setting, in turns")
    ap.add_argument("--steps", type=int, default=61, help="steps per run (a save every 6)")
    ap.add_argument("--write", default=None, help="merge the section into this report (e.g. BENCHMARKS.md)")
    ap.add_argument("--busy", action="store_true", help="the busy host's loop: auto against the last CPU")
    ap.add_argument("--one", nargs=2, metavar=("SETTING", "ROOT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        got = one_busy(args.one[0], args.one[1]) if args.busy else one(args.one[0], args.steps, args.one[1])
        print(json.dumps(got))
        return
    settings = BUSY_SETTINGS if args.busy else SETTINGS
    runs = []
    for r in range(args.runs):
        for s in (settings if r % 2 == 0 else settings[::-1]):  # in turns, each first every other round
            root = tempfile.mkdtemp(prefix="placement-", dir=os.environ.get("TMPDIR", "/tmp"))
            try:
                out = subprocess.run([sys.executable, "-m", "benchmarks.placement", "--steps", str(args.steps),
                                      *(["--busy"] if args.busy else []), "--one", s, root],
                                     capture_output=True, text=True, check=True)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"run {r + 1} {s}: {[round(x * 1e3) for x in runs[-1]['stalls_s']]} ms", flush=True)
    command = "python -m benchmarks.placement " + " ".join(argv if argv is not None else sys.argv[1:])
    from .report import machine_line

    md = (busy_markdown if args.busy else markdown)(runs, command.strip(), machine_line())
    print(md)
    if args.write:
        from .gpu_report import merge

        report = Path(args.write)
        report.write_text(merge(report.read_text(), md, BUSY_HEADING if args.busy else HEADING))
        name = "placement_busy.json" if args.busy else "placement.json"
        Path(report.parent / "benchmarks" / name).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
