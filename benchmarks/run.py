"""Entry point: ``python -m benchmarks.run [--quick] [--out BENCHMARKS.md]``.

Runs every measure for every peer on this machine in one go (each peer/config in a fresh subprocess
unless ``--quick``), then writes the results JSON, a PNG bar chart and the markdown report.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from . import REPO, frameworks, gpu_report, peers, restore_cold, verdicts
from . import workload as wl

SECTIONS = ("io", "core", "rss", "lightning", "lightning_load", "accelerate", "busy", "restore", "cli", "dedup")
DEFAULT_SECTIONS = SECTIONS[:-1]  # dedup (benchmarks/dedup.py) needs peft and transformers: only on --only dedup
# Sections whose report needs nothing from the rest of the run (no shared calibration): a later run may
# replace them in a saved report with --merge-into, each labelled with the run that measured it.
MERGEABLE = ("busy", "restore", "cli", "dedup", "lightning", "accelerate")  # the framework sections carry their plan
# Run only when named (``--only breakdown``): it writes its own section into the report and leaves the rest.
OPTIONAL = ("breakdown",)


@dataclass
class Plan:
    shape: wl.Shape
    warmup: int  # untimed training steps before anything is measured
    every: int  # K: a checkpoint every K steps (plain loop)
    n_ckpt: int  # checkpointed windows in the plain loop
    fw_every: int  # K of the Lightning and Accelerate runs
    fw_n_ckpt: int  # checkpoints in the Lightning and Accelerate timed loops
    base_steps: int  # steps without checkpoints before the first save (the core loop's no-checkpoint RSS peak)
    io_reps: int  # interleaved repeats for (c) and (d)
    cold_load: bool
    rss_saves: int  # saves in the (e) run
    rss_every: int  # steps between the (e) run's saves
    task_timeout: int  # seconds per subprocess
    cold_rounds: int  # rounds of the restore section's cold loads (benchmarks/restore_cold.py)
    # Plain loop sized from this machine's step time (a calibration task measures it first): K is the
    # smallest number of steps that lasts ``window_s`` (at most ``every``), and the number of checkpointed
    # windows grows from ``n_ckpt`` up to ``max_n_ckpt`` to fill ``core_budget_s`` of timed windows per peer.
    # A window's noise grows with sqrt(K) and the estimate's shrinks with sqrt(windows), so on a slow machine
    # shorter windows and more of them measure the same stall far more precisely in the same time.
    window_s: float | None = None
    core_budget_s: float | None = None
    max_n_ckpt: int = 16
    step_s: float | None = None  # the calibrated step time, once known
    # The busy-host scenario (every peer's plain loop beside CPU-bound neighbour processes): its own model,
    # a checkpoint every ``busy_every`` steps, ``busy_n_ckpt`` windows, then ``busy_durable_reps`` save + flush.
    busy_shape: wl.Shape = wl.BUSY
    busy_every: int = 10
    busy_n_ckpt: int = 12  # 4 windows left the busy stall's noise at +-180 ms (2026-11-28): 3x the windows, /1.7
    busy_durable_reps: int = 3
    busy_min_runs: int = verdicts.BUSY_MIN_RUNS  # runs of each before the busy stall's verdict (verdicts.py)
    busy_neighbours: int | None = None  # None: two per CPU (benchmarks/busy.py says why)
    busy_pin: bool = True  # each neighbour pinned to one CPU, round robin
    # Where a stall verdict (plain loop, Lightning, Accelerate, busy host) is inconclusive, fastckpt and its reference
    # run again with ``verdict_n_ckpt`` windows each (``busy_n_ckpt`` on the busy host), pooled with the first run, at
    # most ``verdict_rounds`` times (benchmarks/verdicts.py).
    verdict_rounds: int = 0
    verdict_n_ckpt: int = 12  # 8 + 12 windows: the noise x0.63; 25 windows of the slowest loop fit task_timeout

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = self.shape.to_dict()
        return d

    def calibrated(self, step_s: float) -> "Plan":
        """This plan with ``every`` and ``n_ckpt`` sized for a plain-loop step of ``step_s`` seconds."""
        if self.window_s is None or step_s <= 0:
            return replace(self, step_s=step_s)
        every = min(self.every, max(3, math.ceil(self.window_s / step_s)))
        n_ckpt = self.n_ckpt
        if self.core_budget_s is not None:
            n_ckpt = min(self.max_n_ckpt, max(n_ckpt, int(self.core_budget_s // (2 * every * step_s))))
        # The Lightning and Accelerate loops get the same window rule (never fewer than their own K): with fast
        # steps, a checkpoint every 6 steps outruns the disk (a 1.5 GB checkpoint every ~4 s at 0.6 s steps),
        # and their stall then measures the disk's sustained bandwidth rather than what a checkpoint costs.
        fw_every = max(self.fw_every, min(self.every, math.ceil(self.window_s / step_s)))
        return replace(self, every=every, n_ckpt=n_ckpt, fw_every=fw_every, step_s=step_s)


# Plain loop: a window of at least 8 s (K <= 12 steps) is longer than the slowest asynchronous peer needs
# to persist one 1.5 GB checkpoint on the 2-core benchmark box (every peer's flush was ~0 at 5.3 s windows;
# at 3 s windows DCP's flush alone was ~4 s), so the stall measures what a checkpoint costs the loop, not
# whether the peer keeps up with a very high checkpoint rate. Lightning/Accelerate keep K=6.
FULL_PLAN = Plan(shape=wl.FULL, warmup=2, every=12, n_ckpt=6, fw_every=6, fw_n_ckpt=8, base_steps=4, io_reps=3,
                 cold_load=True, rss_saves=20, rss_every=4, task_timeout=600, cold_rounds=restore_cold.ROUNDS, window_s=8.0, core_budget_s=150.0,
                 verdict_rounds=1)
QUICK_PLAN = Plan(shape=wl.QUICK, warmup=1, every=2, n_ckpt=2, fw_every=2, fw_n_ckpt=2, base_steps=4, io_reps=1,
                  cold_load=True, rss_saves=3, rss_every=2, task_timeout=120, cold_rounds=1, busy_shape=wl.QUICK, busy_every=2,
                  busy_n_ckpt=1, busy_durable_reps=1, busy_min_runs=1)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def check_workdir(path: Path) -> dict[str, str]:
    """The filesystem that holds ``path``; refuses tmpfs (it would measure RAM, not the disk)."""
    import psutil

    path = path.resolve()
    best = None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (str(path) == mp or str(path).startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) > len(best.mountpoint)):
            best = part
    info = {"path": str(path), "device": best.device if best else "?", "fstype": best.fstype if best else "?",
            "mountpoint": best.mountpoint if best else "?"}
    return info


class Runner:
    def __init__(self, workdir: Path, isolate: bool, timeout: int) -> None:
        self.workdir = workdir
        self.isolate = isolate
        self.timeout = timeout
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.count = 0
        self.frozen_before = gc.get_freeze_count()

    def __call__(self, label: str, task: str, args: dict[str, Any]) -> dict[str, Any]:
        self.count += 1
        os.sync()  # start every task with no dirty pages left over from the previous one
        log(f"#{self.count} {label} ...")
        t0 = time.perf_counter()
        if self.isolate:
            res = self._subprocess(label, task, args)
        else:
            from .worker import run_inline

            # In process, every task shares one interpreter that has imported torch, Lightning, Accelerate (and
            # scipy through them): the tasks' own gc.collect() calls (before their RSS samples and loads) each
            # walked those millions of module objects, 0.4 s apiece, 72 of them in a --quick run. The previous
            # task's garbage is collected here and what survives it frozen, so a task's collection walks only
            # what the task itself made, as it would in a fresh worker (isolated runs are left as they were).
            gc.collect()
            gc.freeze()
            res = run_inline(task, args)
        dt = time.perf_counter() - t0
        res["wall_s"] = dt
        if res["ok"]:
            log(f"#{self.count} {label}: done in {dt:.0f}s")
        else:
            log(f"#{self.count} {label}: FAILED in {dt:.0f}s: {res['error']}")
        return res

    def close(self) -> None:
        """In process: the objects frozen before each task go back to the collector (the caller's interpreter
        lives on: a test calls run_all in its own), unless the caller had frozen some itself."""
        if not self.isolate and not self.frozen_before:
            gc.unfreeze()

    def _subprocess(self, label: str, task: str, args: dict[str, Any]) -> dict[str, Any]:
        slug = label.replace(" ", "_").replace("/", "_")
        out = self.logs / f"{self.count:02d}_{slug}.json"
        logf = self.logs / f"{self.count:02d}_{slug}.log"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "benchmarks.worker", task, json.dumps(args), str(out)]
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        try:
            with open(logf, "w") as lf:
                proc = subprocess.run(cmd, cwd=REPO, stdout=lf, stderr=subprocess.STDOUT, env=env,
                                      timeout=self.timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"timed out after {self.timeout}s (log: {logf})"}
        if out.exists():
            return json.loads(out.read_text())
        tail = logf.read_text()[-800:] if logf.exists() else ""
        return {"ok": False, "error": f"worker exited with {proc.returncode} and no result (log: {logf}): {tail}"}


def run_all(plan: Plan, workdir: Path, isolate: bool, sections: tuple[str, ...],
            peer_names: list[str], reps: int = 3) -> dict[str, Any]:
    run = Runner(workdir, isolate, plan.task_timeout)
    try:
        return _sections(run, plan, workdir, sections, peer_names, reps)
    finally:
        run.close()


def _sections(run: Runner, plan: Plan, workdir: Path, sections: tuple[str, ...], peer_names: list[str],
              reps: int) -> dict[str, Any]:
    shape = plan.shape.to_dict()
    ck = str(workdir / "ckpt")
    if {"core", "lightning", "accelerate", "breakdown"} & set(sections) and plan.window_s is not None:
        cal = run("calibrate: plain-loop step time", "calibrate", dict(shape=shape, warmup=plan.warmup, steps=6))
        if cal["ok"]:
            plan = plan.calibrated(cal["result"]["step_s"])
            log(f"calibrated: step {plan.step_s:.2f}s -> a checkpoint every K={plan.every} steps, "
                f"{plan.n_ckpt} checkpointed windows per peer; Lightning/Accelerate every {plan.fw_every} steps")
        else:
            log(f"calibration failed ({cal['error']}); keeping K={plan.every}, {plan.n_ckpt} windows")
    results: dict[str, Any] = {"plan": plan.to_dict()}
    if "breakdown" in sections:
        from .breakdown_run import run_breakdown

        results["breakdown"] = run_breakdown(run, shape, ck, plan.warmup, plan.every, min(plan.n_ckpt, 4), reps)
    if "io" in sections:
        results["io"] = run("io: durable commit + load", "io",
                            dict(shape=shape, root=ck, reps=plan.io_reps))

    def core_args(name: str, n_ckpt: int) -> dict[str, Any]:
        return dict(peer=name, shape=shape, root=ck, warmup=plan.warmup, every=plan.every, n_ckpt=n_ckpt,
                    base_steps=plan.base_steps)

    if "core" in sections:
        results["core"] = {}
        for name in peer_names:
            why = peers.PEERS[name].missing()
            if why:  # an optional peer whose package is not installed: reported as skipped, not failed
                log(f"core loop: {name}: skipped, {why}")
                results["core"][name] = {"ok": False, "skipped": why, "error": f"skipped: {why}"}
                continue
            results["core"][name] = run(f"core loop: {name}", "core", core_args(name, plan.n_ckpt))
        verdicts.top_up(run, results, "core", core_args, plan.verdict_rounds, plan.verdict_n_ckpt, log)
    if "rss" in sections:
        results["rss"] = run(f"rss: fastckpt x{plan.rss_saves} saves", "rss",
                             dict(shape=shape, root=ck, warmup=plan.warmup, every=plan.rss_every,
                                  n_saves=plan.rss_saves, base_steps=max(2, plan.base_steps // 3)))
    if "busy" in sections:
        results["busy"] = run_busy(run, plan, ck, peer_names)
    if "lightning_load" in sections:
        results["lightning_load"] = run("lightning: load_from_checkpoint, fastckpt vs torch.save", "lightning_load",
                                        dict(shape=shape, root=ck, reps=plan.io_reps, cold=plan.cold_load))
    if "restore" in sections:
        from .restore_run import run_restore

        results["restore"] = run_restore(run, shape, workdir, peer_names, plan.cold_load,
                                         4 if plan.shape == wl.QUICK else 150, plan.cold_rounds)
    fw = dict(shape=shape, root=ck, warmup=plan.warmup, every=plan.fw_every, n_ckpt=plan.fw_n_ckpt)
    if "cli" in sections:
        results["cli"] = _cli_help(5)
    if "dedup" in sections:
        from .dedup import run_dedup

        log("dedup: bytes sent per checkpoint, LoRA and frozen embeddings (GPT-2 from a config)")
        results["dedup"] = run_dedup(workdir)
    for section, configs in (("lightning", frameworks.LIGHTNING_CONFIGS),
                             ("accelerate", frameworks.ACCELERATE_CONFIGS)):
        if section not in sections:
            continue
        # the plan its windows were cut by: the section then reads alone (--merge-into into another run's report)
        res: dict[str, Any] = {"baseline": [], "plan": {"fw_every": plan.fw_every, "fw_n_ckpt": plan.fw_n_ckpt,
                                                        "step_s": plan.step_s}}
        for cfg in configs:  # the stall is paired inside each run; the baseline run is the RSS reference
            r = run(f"{section}: {cfg}", section, dict(fw, config=cfg))
            if cfg == "baseline":
                res["baseline"].append(r)
            else:
                res[cfg] = r
        results[section] = res
        verdicts.top_up(run, results, section, lambda cfg, n: dict(fw, config=cfg, n_ckpt=n),
                        plan.verdict_rounds, plan.verdict_n_ckpt, log)
    return results


def _cli_help(reps: int) -> dict[str, Any]:
    """``cli_help_s``: how long ``fastckpt --help`` takes in a fresh interpreter (benchmarks/cli.py)."""
    from . import cli

    log("cli: fastckpt --help start-up time")
    try:
        return {"ok": True, "result": cli.measure(reps)}
    except (subprocess.SubprocessError, OSError) as e:
        return {"ok": False, "error": str(e)}


def run_busy(run: Runner, plan: Plan, ck: str, peer_names: list[str]) -> dict[str, Any]:
    """The busy-host scenario for every peer (optional peers that are not installed: skipped, named)."""
    from .busy import default_neighbours

    n = plan.busy_neighbours or default_neighbours()
    log(f"busy host: {n} CPU-bound neighbour processes beside every peer's loop")
    out: dict[str, Any] = {"neighbours": n, "pinned": plan.busy_pin, "peers": {}, "plan": {  # a section may be merged
        "busy_shape": plan.busy_shape.to_dict(), "busy_every": plan.busy_every, "busy_n_ckpt": plan.busy_n_ckpt,
        "busy_durable_reps": plan.busy_durable_reps, "busy_min_runs": plan.busy_min_runs}}
    def args(peer: str, with_neighbours: bool = True, n_ckpt: int = plan.busy_n_ckpt) -> dict[str, Any]:
        return dict(peer=peer, shape=plan.busy_shape.to_dict(), root=ck, warmup=plan.warmup, every=plan.busy_every,
                    n_ckpt=n_ckpt, base_steps=plan.base_steps, durable_reps=plan.busy_durable_reps,
                    n_neighbours=n if with_neighbours else 0, limit_s=float(plan.task_timeout), pin=plan.busy_pin)

    for name in peer_names:
        why = peers.PEERS[name].missing()
        if why:
            log(f"busy host: {name}: skipped, {why}")
            out["peers"][name] = {"ok": False, "skipped": why, "error": f"skipped: {why}"}
            continue
        out["peers"][name] = run(f"busy host: {name}", "busy", args(name))
    if "fastckpt" in peer_names:  # the same loop without neighbours: issue 27's "no worse than 2x the quiet stall"
        out["quiet"] = run("busy host: fastckpt with no neighbours (reference)", "busy", args("fastckpt", False))
        verdicts.top_up_busy(run, out, lambda with_neighbours, n_ckpt: args("fastckpt", with_neighbours, n_ckpt),
                             plan.verdict_rounds, plan.busy_n_ckpt, log, plan.busy_min_runs)
    return out


QUICK_OUT = REPO / "benchmarks" / "out-quick"  # ignored by git: a smoke run never replaces the committed report


def default_outputs(out_arg: str | None, quick: bool) -> tuple[Path, Path, Path]:
    """Report, chart and JSON paths. Only a full run writes the committed BENCHMARKS.md and
    benchmarks/results.{png,json} by default; ``--quick`` writes into QUICK_OUT unless ``--out`` is given."""
    if out_arg is None and not quick:
        return REPO / "BENCHMARKS.md", REPO / "benchmarks" / "results.png", REPO / "benchmarks" / "results.json"
    out = Path(out_arg) if out_arg else QUICK_OUT / "BENCHMARKS.md"
    return out, out.with_suffix(".png"), out.with_suffix(".json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps, in-process: a smoke test")
    ap.add_argument("--out", default=None, help="markdown report (default: BENCHMARKS.md at the repo root; "
                                               "with --quick: benchmarks/out-quick/BENCHMARKS.md)")
    ap.add_argument("--chart", default=None, help="PNG chart (default: benchmarks/results.png next to --out)")
    ap.add_argument("--json", default=None, help="raw results (default: benchmarks/results.json next to --out)")
    ap.add_argument("--workdir", default=None,
                    help="checkpoint scratch dir on the disk under test (default: bench_out/ in the repo)")
    ap.add_argument("--only", default=",".join(DEFAULT_SECTIONS), help=f"comma list of sections: {','.join(SECTIONS)}")
    ap.add_argument("--peers", default=",".join(peers.ORDER), help="comma list of core-loop peers")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="one subprocess per task (default: on, off with --quick)")
    ap.add_argument("--from-json", default=None,
                    help="re-render the report and chart from a saved results.json, measuring nothing")
    ap.add_argument("--merge-into", default=None, metavar="RESULTS_JSON",
                    help="with --only among " + ",".join(MERGEABLE) + ": add this run's sections (each labelled "
                         "with its own command, machine and date) to a saved results.json, then re-render that "
                         "run's report")
    ap.add_argument("--verdict-rounds", type=int, default=None,
                    help="extra runs (more windows) of fastckpt and its reference where a stall verdict is "
                         "inconclusive (default: 1 in a full run, 0 with --quick; 0 turns them off)")
    ap.add_argument("--breakdown-reps", type=int, default=3, help="runs of each configuration in --only breakdown")
    args = ap.parse_args(argv)

    from . import report

    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        out = Path(args.out) if args.out else REPO / "BENCHMARKS.md"
        chart_default = REPO / "benchmarks" / "results.png" if args.out is None else out.with_suffix(".png")
        chart = Path(args.chart) if args.chart else chart_default
        summary = report.summarize(results)
        report.chart(summary, chart)
        out.write_text(gpu_report.carried(report.markdown(results, summary, chart_rel=os.path.relpath(chart, out.parent)), out))
        print(report.console_table(summary))
        return 0

    out, chart_default, json_default = default_outputs(args.out, args.quick)
    chart = Path(args.chart) if args.chart else chart_default
    json_path = Path(args.json) if args.json else json_default
    for path in (out, chart):
        path.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir) if args.workdir else REPO / "bench_out"
    workdir.mkdir(parents=True, exist_ok=True)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    if args.verdict_rounds is not None:
        if args.verdict_rounds < 0:
            ap.error(f"--verdict-rounds must be 0 or more, got {args.verdict_rounds}")
        plan = replace(plan, verdict_rounds=args.verdict_rounds)
    isolate = (not args.quick) if args.isolate is None else args.isolate
    sections = tuple(s for s in args.only.split(",") if s)
    bad = [s for s in sections if s not in SECTIONS + OPTIONAL]
    if args.merge_into and (not sections or any(sec not in MERGEABLE for sec in sections)):
        ap.error(f"--merge-into merges only self-contained sections: use it with --only among {','.join(MERGEABLE)}")
    peer_names = [p for p in args.peers.split(",") if p]
    bad += [p for p in peer_names if p not in peers.PEERS]
    if bad:
        ap.error(f"unknown section/peer: {bad}")

    disk = check_workdir(workdir)
    if disk["fstype"] in ("tmpfs", "ramfs") and not args.quick:
        ap.error(f"--workdir {workdir} is on {disk['fstype']}: pick a directory on a real disk")
    command = "python -m benchmarks.run " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    meta = report.machine_info(workdir, disk)
    meta.update(command=command.strip(), quick=args.quick, isolate=isolate, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    log(f"fastckpt benchmarks ({'QUICK smoke run' if args.quick else 'full run'}), checkpoints under "
        f"{workdir} ({disk['fstype']} on {disk['device']}), torch threads for training: {wl.TRAIN_THREADS}")
    t0 = time.perf_counter()
    results = run_all(plan, workdir, isolate, sections, peer_names, args.breakdown_reps)
    meta["wall_s"] = time.perf_counter() - t0
    meta["loadavg_end"] = os.getloadavg()
    results["meta"] = meta
    if sections == ("breakdown",):  # its own section only: the rest of the report is another run's
        from . import breakdown_run

        from .report import machine_line

        machine = machine_line(meta.get("cpu", "?"), meta.get("logical_cpus"), meta["loadavg_end"][0], meta["started"])
        breakdown_run.write(results["breakdown"], out, json_path.with_name("breakdown.json"), meta["command"], machine)
        log(f"wrote the section {breakdown_run.HEADING!r} into {out} in {meta['wall_s']:.0f}s")
        return 0
    if args.merge_into:  # the other run's report, plus these sections (each names its own run)
        json_path = Path(args.merge_into)
        merged = json.loads(json_path.read_text())
        for sec in sections:
            if isinstance(results.get(sec), dict):
                results[sec]["meta"] = meta
                merged[sec] = results[sec]
        results = merged
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1))
    summary = report.summarize(results)
    report.chart(summary, chart)
    md = report.markdown(results, summary, chart_rel=os.path.relpath(chart, out.parent))
    out.write_text(gpu_report.carried(md, out))  # the GPU section comes from benchmarks/gpu.sh runs only
    log(f"wrote {out}, {chart}, {json_path} in {meta['wall_s']:.0f}s")
    print(report.console_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
