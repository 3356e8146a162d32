"""What each kind of background pass over the state costs the training step, per GB of state it passes over:
``python -m benchmarks.copyfloor [--steps N] [--reps N] [--json PATH]``.

The plain loop's stall is, mostly, the training step slowed by the background work beside it (BENCHMARKS.md, "Where
the stall goes": the training thread's own CPU time grows). On 2 CPUs that is not a CPU share: the training thread
keeps its CPU. It is memory bandwidth: the model's steps (batch 1, 1.48 GB of parameters and AdamW state) stream
their weights and optimizer state, and a copy beside them streams too. This measures it directly: the harness's
training step (benchmarks/workload.py, the full model, one intra-op thread) on the first CPU, and on the second a
process doing one kind of background pass over and over, each over 16 MiB tensors of a 768 MiB state (never in
cache): its rate (GB of state per second) and the step's slowdown give the training time lost per GB of state.

Kinds: ``copy_`` (torch's copy into a preallocated buffer, the two-pass path's copy), ``memmove`` in 1 MiB chunks
(the one pass's fill), ``memmove-nt`` (one call over the whole state, above glibc's non-temporal threshold: streaming
stores, no read for ownership), ``paced`` (the 1 MiB memmove at half duty: the same bytes spread over twice the
time), ``one-pass`` (engine/onepass.py's work: each 1 MiB block copied, then its CRC32C and health statistics while
in cache), ``crc32c`` (a read-only pass from DRAM), ``io-pass`` (the two-pass path's I/O worker: CRC32C and health
statistics over the staged bytes, from DRAM), ``disk-write`` (the staged bytes written to a file on the disk under test
with O_DIRECT, as the I/O workers write a shard, over and over: the device reads them from memory). Each kind runs
``--reps`` times in turns, between idle spells. The optimizer step is timed on its own too (its pre and post hooks):
where a pass's cost falls within the step says whether timing the background work around the optimizer step could
spare the training any of it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import REPO, repo_env

HEADING = "## The floor: what each pass over the state costs the training step"
KINDS = ("copy_", "memmove", "memmove-nt", "paced", "one-pass", "crc32c", "io-pass", "disk-write")
STATE = 768 << 20  # bytes the background pass walks: 24x the L3 here, so every pass streams from DRAM
TENSOR = 16 << 20
# A kind's loss is split between the optimizer step and the rest only where the step slowed by at least this much
_SHARE_ABOVE = 0.05
_ALIKE = 0.15  # the optimizer step's share of the loss within this of its share of the step: the loss is spread alike
SHAPES = {"full": "FULL", "quick": "QUICK"}  # the training step beside the pass: benchmarks/workload.py's shapes

# The background process: one kind over and over on its own CPU; prints "ready", then its rate in GB of state per
# second every half second or so (cumulative since ready).
_WORKER = r'''
import ctypes, mmap, os, sys, time
import torch
from fastckpt.format.checksum import crc32c
from fastckpt.format.healthpass import tensor_pass
kind, cpu, state, tensor, scratch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
os.sched_setaffinity(0, {cpu})
torch.set_num_threads(1)
from fastckpt.engine.onepass import CHUNK as chunk  # the one pass's block: copied, then checksummed and measured
src = [torch.randn(tensor // 4) for _ in range(state // tensor)]
if kind == "memmove-nt":  # one buffer each way: a single call above glibc's non-temporal threshold
    whole_s, whole_d = torch.cat(src), torch.empty(state // 4)
    src = []
dst = [torch.empty_like(t) for t in src]
if kind == "disk-write":  # page-aligned buffers (O_DIRECT), filled; one file of the state's size, overwritten
    bufs = [mmap.mmap(-1, tensor) for _ in range(state // tensor)]
    for b, s in zip(bufs, src):
        b.write(s.numpy().tobytes())
    fd = os.open(os.path.join(scratch, "copyfloor.bin"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)

def fill(d, s):
    dp, sp = d.data_ptr(), s.data_ptr()
    return lambda at, n: ctypes.memmove(dp + at, sp + at, n)

def once():
    if kind == "disk-write":
        for i, b in enumerate(bufs):
            os.pwrite(fd, b, i * tensor)
        return
    if kind == "memmove-nt":
        ctypes.memmove(whole_d.data_ptr(), whole_s.data_ptr(), state)
        return
    for s, d in zip(src, dst):
        if kind == "copy_":
            d.copy_(s)
        elif kind in ("memmove", "paced"):
            f = fill(d, s)
            for at in range(0, tensor, chunk):
                t0 = time.perf_counter()
                f(at, chunk)
                if kind == "paced":
                    time.sleep(time.perf_counter() - t0)
        elif kind == "one-pass":
            tensor_pass(d.view(torch.uint8), torch.float32, crc=True, block=chunk // 4, fill=fill(d, s))
        elif kind == "crc32c":
            crc32c(memoryview(d.numpy()))
        elif kind == "io-pass":
            tensor_pass(d.view(torch.uint8), torch.float32, crc=True)

once()
n, t0, last = 0, time.monotonic(), 0.0
print("ready", flush=True)
while True:
    once()
    n += state
    now = time.monotonic()
    if now - last > 0.5:
        print(f"{n / (now - t0) / 1e9:.4f}", flush=True)
        last = now
'''


def measure(kinds: tuple[str, ...], steps: int, reps: int, scratch: str, shape: str = "full",
            state: int = STATE) -> dict:
    """Median step time idle and beside each kind (``reps`` spells each, in turns, each kind's between two idle
    spells), the kind's rate, and the training time lost per GB of state."""
    from . import workload as wl

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("benchmarks.copyfloor needs two CPUs: training on one, the background pass on another")
    os.sched_setaffinity(0, {cpus[0]})
    wl.setup_threads()
    wl.tune_malloc()
    model, opt = wl.build(getattr(wl, SHAPES[shape]))
    batches = wl.Batches(getattr(wl, SHAPES[shape]))
    for _ in range(3):
        wl.train_step(model, opt, batches)

    opt_s: list[float] = []  # each optimizer step's own seconds, from its pre and post hooks
    began = [0.0]

    def pre(*_: object) -> None:
        began[0] = time.perf_counter()

    def post(*_: object) -> None:
        opt_s.append(time.perf_counter() - began[0])

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)

    def spell() -> tuple[float, float]:
        """The median step over ``steps`` steps, and the median of their optimizer steps."""
        ts = []
        for _ in range(steps):
            t0 = time.perf_counter()
            wl.train_step(model, opt, batches)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts), statistics.median(opt_s[-steps:])

    env = repo_env()
    out: dict = {"state_bytes": state, "shape": shape, "tensor_bytes": TENSOR, "steps": steps,
                 "runs": {k: [] for k in kinds}, "idle_s": [],
                 "train_state_bytes": wl.tensor_bytes(wl.make_state(model, opt, 0))}
    for r in range(reps):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            before, opt_before = spell()
            p = subprocess.Popen([sys.executable, "-c", _WORKER, kind, str(cpus[1]), str(state), str(TENSOR),
                                  scratch], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
            try:
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"background pass {kind!r} did not start")
                p.stdout.readline()  # its first rate: it runs now
                busy, opt_busy = spell()
                rate = float(p.stdout.readline())
            finally:
                p.kill()
                p.wait()
            after, opt_after = spell()
            idle, opt_idle = (before + after) / 2, (opt_before + opt_after) / 2
            out["idle_s"] += [before, after]
            lost = (busy - idle) / (rate * busy)  # training seconds lost per GB of state passed over
            out["runs"][kind].append({"idle_s": idle, "busy_s": busy, "gb_s": rate, "lost_s_per_gb": lost,
                                      "opt_idle_s": opt_idle, "opt_busy_s": opt_busy})
            print(f"{kind:10} step {idle * 1e3:6.0f} -> {busy * 1e3:6.0f} ms (optimizer {opt_idle * 1e3:4.0f} -> "
                  f"{opt_busy * 1e3:4.0f}) beside {rate:5.2f} GB/s: {lost * 1e3:5.1f} ms lost per GB", flush=True)
    return out


def optimizer_share(runs: list[dict]) -> tuple[float, float] | None:
    """Of the training time a kind's runs lost, the fraction lost inside the optimizer step, and the optimizer step's
    fraction of the idle step (over the runs that timed it, pooled); None where they did not, or where the step slowed
    by under ``_SHARE_ABOVE`` (the fraction of a loss within the noise says nothing)."""
    split = [r for r in runs if "opt_idle_s" in r]
    lost = sum(r["busy_s"] - r["idle_s"] for r in split)
    idle = sum(r["idle_s"] for r in split)
    if not split or lost < _SHARE_ABOVE * idle:
        return None
    return sum(r["opt_busy_s"] - r["opt_idle_s"] for r in split) / lost, sum(r["opt_idle_s"] for r in split) / idle


def summary(res: dict) -> str:
    gb = res["train_state_bytes"] / 1e9
    per_ckpt = f"per checkpoint of {gb:.2f} GB"
    lines = [f"{'kind':10} {'GB/s':>6} {'ms lost per GB (median, runs)':>36} {per_ckpt:>24}  lost in optimizer"]
    for kind, runs in res["runs"].items():
        lost = [r["lost_s_per_gb"] * 1e3 for r in runs]
        m = statistics.median(lost)
        share = optimizer_share(runs)
        lines.append(f"{kind:10} {statistics.median(r['gb_s'] for r in runs):6.2f} "
                     f"{m:8.1f} ({', '.join(f'{x:.0f}' for x in lost)}){'':>8} {m * gb:18.0f} ms  "
                     + (f"{share[0]:.0%} (of the step: {share[1]:.0%})" if share else "-"))
    return "\n".join(lines)


def pooled(results: list[dict]) -> dict[str, list[float]]:
    """Every run's ms lost per GB, by kind, over several measurements (``--from``)."""
    out: dict[str, list[float]] = {}
    for res in results:
        for kind, runs in res["runs"].items():
            out.setdefault(kind, []).extend(r["lost_s_per_gb"] * 1e3 for r in runs)
    return out


def markdown(results: list[dict], command: str, machine: str) -> str:
    """The report's section: per kind the median ms lost per GB over every run pooled, the runs, and what it makes
    per checkpoint of the harness's state; then the floor of a snapshot that is copied once and written once."""
    lost = pooled(results)
    gb = results[0]["train_state_bytes"] / 1e9
    rates: dict[str, list[float]] = {}
    for res in results:
        for kind, runs in res["runs"].items():
            rates.setdefault(kind, []).extend(r["gb_s"] for r in runs)
    lines = [HEADING, "", f"Reproduce: `{command}` ({machine}); {len(results)} measurement(s) pooled, "
             f"{sum(len(v) for v in lost.values())} runs. Method: benchmarks/copyfloor.py's docstring: the harness's "
             f"training step ({gb:.2f} GB of state, one thread) on one CPU, one kind of pass over a state far larger "
             "than the cache on the other, the step's slowdown divided by the GB the pass got through.", "",
             f"| pass beside the training step | rate | training time lost per GB (median; every run) "
             f"| per checkpoint of {gb:.2f} GB | of the time lost, in the optimizer step (its share of the idle "
             "step) |",
             "|---|---|---|---|---|"]
    shares = {kind: optimizer_share([r for res in results for r in res["runs"].get(kind, ())]) for kind in lost}
    for kind in KINDS:
        if kind in lost:
            m = statistics.median(lost[kind])
            share = shares[kind]
            lines.append(f"| `{kind}` | {statistics.median(rates[kind]):.1f} GB/s | {m:.1f} ms "
                         f"({', '.join(f'{x:.0f}' for x in sorted(lost[kind]))}) | {m * gb:.0f} ms | "
                         + (f"{share[0]:.0%} ({share[1]:.0%}) |" if share else "- |"))
    if "copy_" in lost and "disk-write" in lost:
        copy, disk = statistics.median(lost["copy_"]), statistics.median(lost["disk-write"])
        lines += ["", f"**Floor.** A checkpoint that snapshots the state (one copy) and makes it durable (the disk "
                  f"takes it once) costs the training step about {copy:.0f} + {disk:.0f} ms per GB here: "
                  f"{(copy + disk) * gb:.0f} ms per checkpoint of {gb:.2f} GB, whoever does the work and however "
                  "it is paced. Passes that only read (a CRC32C, the health statistics from DRAM) cost next to "
                  "nothing."]
    if shares.get("copy_"):
        lost_in, takes = shares["copy_"]
        where = ("so the write passes slow every part of the step alike: timing them around the optimizer step "
                 "(holding them back during it, or running them only then) cannot lower their cost"
                 if abs(lost_in - takes) < _ALIKE else
                 "so the loss gathers " + ("in" if lost_in > takes else "outside") + " the optimizer step: pausing "
                 "the background writes " + ("during" if lost_in > takes else "outside") + " it would spare part of it")
        lines += ["", f"**Where in the step.** Of the time the `copy_` pass costs the step, {lost_in:.0%} is lost "
                  f"inside the optimizer step (timed by its pre and post hooks), which takes {takes:.0%} of the idle "
                  f"step; {where}."]
    return "\n".join(lines) + "\n"


def _as_list(data: dict | list) -> list[dict]:
    return data if isinstance(data, list) else [data]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.copyfloor", description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {','.join(KINDS)}")
    ap.add_argument("--steps", type=int, default=9, help="training steps per spell (the median is taken)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the measurement here (with --from: the pooled list)")
    ap.add_argument("--from", dest="sources", nargs="+", default=None, metavar="JSON",
                    help="measure nothing: pool these saved --json results into the summary (and --write)")
    ap.add_argument("--write", default=None, help="merge the section into this report (e.g. BENCHMARKS.md)")
    ap.add_argument("--shape", default="full", choices=sorted(SHAPES), help="the training step's model")
    ap.add_argument("--state-mb", type=int, default=STATE >> 20,
                    help="MiB of state the background pass walks (a multiple of 16; far above the L3 to stream)")
    ap.add_argument("--workdir", default=None, help="scratch directory on the disk under test, for disk-write "
                                                   "(default: bench_out/ in the repo)")
    a = ap.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k)
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds or a.steps < 1 or a.reps < 1:
        ap.error(f"--kinds among {','.join(KINDS)} (got {bad or 'none'}); --steps and --reps at least 1")
    if a.state_mb < 16 or a.state_mb % 16:
        ap.error(f"--state-mb must be a positive multiple of 16, got {a.state_mb}")
    if a.sources:  # each a --json file: one measurement, or a list of them (this command's --json with --from)
        results = [r for p in a.sources for r in _as_list(json.loads(Path(p).read_text()))]
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=1))
    else:
        workdir = Path(a.workdir) if a.workdir else REPO / "bench_out"
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="copyfloor-", dir=workdir) as scratch:
            results = [measure(kinds, a.steps, a.reps, scratch, a.shape, a.state_mb << 20)]
        if a.json:
            Path(a.json).write_text(json.dumps(results[0], indent=1))
    print()
    for res in results:
        print(summary(res))
    if a.write:
        from .gpu_report import merge
        from .report import machine_line

        command = "python -m benchmarks.copyfloor " + " ".join(argv if argv is not None else sys.argv[1:])
        report = Path(a.write)
        report.write_text(merge(report.read_text(), markdown(results, command.strip(), machine_line()), HEADING))
    return 0


if __name__ == "__main__":
    sys.exit(main())
