"""What one checkpoint costs a *launch-bound* training thread, and the CPU time it takes:
``python -m benchmarks.launchbound [--peers a,b] [--rounds N] [--n-ckpt N] [--window S] [--json PATH] [--quick]``.

On a GPU the Python thread that launches the kernels is the bottleneck: every GIL hold, CPU cycle or host sync the
background takes from it is stall. This stands a CPU thread in for it: the training thread runs tiny ops (a few
16-value adds, microseconds each, as kernel launches are) on CPU 0, one intra-op thread, and counts how many it
runs. A checkpoint is saved (W1: the GPT-2-small shape + AdamW, 1.48 GB of float32 state, 580 tensors) and the
training thread goes on launching until the window's end (a window lasts ``--window`` seconds, or 1.5 times the
peer's first checkpoint to durable plus a second, a tenth of one with ``--quick``, where that is longer) (on a GPU
its optimizer step waits for the copies on the device, not on the host; ``--step-ms N`` makes it wait on the host
where the peer says it must, after N ms of launches, which on this CPU adds the copy's own time); the launches it
lost against the clean windows on either side, divided by the clean rate, are the **time lost** by that checkpoint.
The window is long enough for the checkpoint to be durable in it; what the training thread still waits at the
window's end for it counts as lost.
The training thread is pinned to its CPU only while it launches: a peer's threads, made inside its constructor or
``save()`` by the training thread, must not inherit that one CPU (they did before 2026-12-07, and every peer's
background then shared the training thread's core: fastckpt's ran there with a 480 ms wait for the CPU a
checkpoint). **Stalled** is the other, steadier figure: the training thread times every iteration of 64 launches,
and an iteration slower than three times the clean windows' median counts its excess over that median (the time
the thread waited for the GIL or for its CPU); the same sum over the clean windows on either side, per second,
is taken off. It leaves out a uniform slowdown (shared caches, memory bandwidth) that *time lost* includes, and it
does not swing with the host's speed, which moves the clean rate by tens of percent between windows here.

Per peer, in a fresh process each (peers in turns, ``--rounds`` times): its staging prewarmed where it offers it
(fastckpt's ``prewarm``, torch_checkpointing's ``prewarm_staging``), one warm-up checkpoint (timed as the first), then
``--n-ckpt`` timed windows, then ``--n-cpu`` checkpoints with the training thread idle, each from ``save()`` to
durable: the **CPU-seconds** of this process and of its children (live ones through psutil: a writer or persister
process that has not exited is missing from ``RUSAGE_CHILDREN``), and the ``save()`` call's own time. CPU-seconds
are stable on a busy host, where the wall-clock figures are not.

Peers: ``fastckpt`` (defaults, health statistics on), ``fastckpt-nohealth``, ``dcp_stager`` (DCP ``async_save`` +
a reused ``DefaultStager``), ``torch_checkpointing`` (Meta's ``CheckpointManager``, async save, its writer
process; local writes without O_DIRECT, which this file system refuses for its unaligned buffers), ``torch_save``.
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
from typing import Any

from . import REPO, repo_env

HEADING = "## The launch-bound training thread"
PEERS = ("fastckpt", "fastckpt-nohealth", "dcp_stager", "torch_checkpointing", "torch_save")
# fastckpt variants by config that only this benchmark drives, for A/B runs beside the defaults (not in the default
# --peers); benchmarks/peers.py's own (fastckpt-torchpass, fastckpt-compiled, ...) are named as they are
VARIANTS = {"fastckpt-nohealth": {"health": {"enabled": False}}}
_OPS_PER_ITER = 4  # tiny ops per counted iteration


def make_peer(name: str, root: Path) -> Any:
    """The peer adapter: benchmarks/peers.py's, plus the ones only this benchmark drives."""
    from . import peers

    if name in VARIANTS:
        cls = type("FastckptVariant", (peers.Fastckpt,), {"name": name, "config": VARIANTS[name]})
        return _Fast(cls(root))
    if name == "torch_checkpointing":
        return TorchCheckpointing(root)
    peer = peers.make(name, root)
    return _Fast(peer) if isinstance(peer, peers.Fastckpt) else peer


class _Fast:
    """fastckpt as a GPU job uses it: the optimizer's step pre-hook (``watch``) waits for staging; here there is no
    optimizer step, so the adapter waits where the hook would (``wait_staged``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def before_optimizer_step(self) -> None:
        self.inner.ckpt.wait_staged()

    def prewarm(self, state: dict) -> None:
        if hasattr(self.inner.ckpt, "prewarm"):  # a fastckpt before Checkpointer.prewarm (a baseline checkout)
            self.inner.ckpt.prewarm(state).result()


class TorchCheckpointing:
    """Meta's torch_checkpointing ``CheckpointManager`` (0.1.1): ``save()`` returns the write future at once;
    staging runs on its thread (``_staging_future``: when the state may change), a writer process writes."""

    name = "torch_checkpointing"

    def __init__(self, root: Path) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.mgr = CheckpointManager(CheckpointManager.Config(
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))
        self.write: Any = None

    def attach(self, model: Any, opt: Any) -> None:
        pass

    def save(self, state: dict, step: int) -> None:
        if self.write is not None:
            self.write.result()
        self.write = self.mgr.save(str(self.root / f"step-{step:09d}"), state)

    def prewarm(self, state: dict) -> None:
        self.mgr.prewarm_staging(state)

    def before_optimizer_step(self) -> None:
        fut = getattr(self.mgr, "_staging_future", None)
        if fut is not None:
            fut.result()

    def flush(self) -> None:
        if self.write is not None:
            self.write.result()
            self.write = None

    def close(self) -> None:
        self.flush()
        self.mgr.close()


class Launcher:
    """The launch-bound training thread: tiny ops, counted, on ``cpu`` while it launches (None: where it runs);
    each iteration's time is kept (``times``) for the stall figure."""

    SLOW = 3.0  # an iteration slower than this many clean medians stalled

    def __init__(self, cpu: int | None = None) -> None:
        import numpy as np
        import torch

        self.a, self.b, self.c = torch.ones(16), torch.ones(16), torch.empty(16)
        self.add = torch.add
        self.cpu = cpu
        self.times = np.zeros(1 << 22)  # seconds per iteration of the last run (64 launches each)
        self.count = 0

    def run_until(self, deadline: float) -> int:
        """Launch until ``deadline`` (perf_counter); returns the iterations run (of 64 launches each)."""
        mask = os.sched_getaffinity(0)
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})  # this thread only (0: the caller): threads it makes later do not inherit it
        try:
            return self._run(deadline)
        finally:
            if self.cpu is not None:
                os.sched_setaffinity(0, mask)

    def _run(self, deadline: float) -> int:
        a, b, c, add, times, now = self.a, self.b, self.c, self.add, self.times, time.perf_counter
        cap = len(times) - 1
        n = 0
        t = now()
        while t < deadline:
            for _ in range(4):
                add(a, b, out=c)
                add(c, b, out=c)
                add(a, c, out=c)
                add(c, a, out=c)
            t2 = now()
            times[min(n, cap)] = t2 - t
            t = t2
            n += 1
        self.count = min(n, cap)
        return n * 4

    def stalled(self, median: float) -> float:
        """Seconds of the last run's iterations beyond ``median`` where slower than ``SLOW`` medians."""
        x = self.times[:self.count]
        slow = x[x > self.SLOW * median]
        return float((slow - median).sum())

    def median(self) -> float:
        import numpy as np

        return float(np.median(self.times[:self.count])) if self.count else 0.0


def cpu_now() -> float:
    """CPU seconds of this process and of every child, live or exited."""
    import resource

    import psutil

    me = resource.getrusage(resource.RUSAGE_SELF)
    gone = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            live += t.user + t.system
        except psutil.Error:
            pass
    return me.ru_utime + me.ru_stime + gone.ru_utime + gone.ru_stime + live


def measure(name: str, n_ckpt: int, n_cpu: int, window: float, step_ms: float, quick: bool,
            touch: bool = False) -> dict[str, Any]:
    """One peer, in this process: the time lost per checkpoint, CPU-seconds per checkpoint, save() times (``touch``:
    every floating-point tensor of the state rewritten in place, untimed, before each save, as an optimizer step
    would: on a VM where memory left idle for seconds is slow to touch again, the saves read it warm)."""
    import torch

    from .workload import FULL, QUICK, build, make_state, tensor_bytes, train_step, Batches, unique_tensors

    os.sched_setaffinity(0, {0, 1} & os.sched_getaffinity(0) or os.sched_getaffinity(0))
    torch.set_num_threads(1)
    shape = QUICK if quick else FULL
    model, opt = build(shape)
    train_step(model, opt, Batches(shape))  # AdamW's state exists
    state = make_state(model, opt, 0)
    nbytes = tensor_bytes(state)
    tensors = len(unique_tensors(state))
    floats = [t for t in unique_tensors(state) if t.is_floating_point()]

    def warm_state() -> None:
        if touch:
            with torch.no_grad():
                torch._foreach_mul_(floats, 1.0)
    first = sorted(os.sched_getaffinity(0))[0]
    # the training thread on one CPU while it launches (a GPU job's launching thread); the peer's threads go where
    # they go: they are made while it is not pinned, so they do not inherit its one CPU
    launcher = Launcher(first)
    launcher.run_until(time.perf_counter() + 0.3)  # warm
    with tempfile.TemporaryDirectory(prefix=f"launchbound-{name}-", dir=os.environ.get("LAUNCHBOUND_DIR")) as root:
        peer = make_peer(name, Path(root))
        peer.attach(model, opt)
        if hasattr(peer, "prewarm"):  # buffers made before the first save, where the peer offers it (untimed)
            peer.prewarm(state)
        step = 1
        t = time.perf_counter()
        peer.save(state, step)
        peer.before_optimizer_step()
        peer.flush()
        first_s = time.perf_counter() - t
        # each window holds a whole checkpoint to durable with room to spare: what the training thread then still
        # waits at the window's end is not a peer's background running long (--quick: the tiny model's checkpoint is
        # durable in milliseconds, and a spare second held a smoke run's --window 0.2 at 1.1 s, three times a peer)
        window = max(window, 1.5 * first_s + (0.1 if quick else 1.0))
        clean: list[float] = []
        clean_stall: list[float] = []  # stalled seconds per second of each clean window
        medians: list[float] = []
        lost: list[float] = []
        stalled: list[float] = []
        saves: list[float] = []
        waited: list[float] = []

        def clean_rate() -> float:
            t0 = time.perf_counter()
            n = launcher.run_until(t0 + window)
            took = time.perf_counter() - t0
            medians.append(launcher.median())
            clean_stall.append(launcher.stalled(medians[-1]) / took)
            return n / took

        clean.append(clean_rate())
        for _ in range(n_ckpt):
            step += 1
            warm_state()
            t0 = time.perf_counter()
            peer.save(state, step)
            t1 = time.perf_counter()
            n = launcher.run_until(t1 + step_ms / 1e3) if step_ms else 0
            t2 = time.perf_counter()
            if step_ms:
                peer.before_optimizer_step()
            t3 = time.perf_counter()
            n += launcher.run_until(t0 + window)
            t4 = time.perf_counter()
            peer.flush()  # durable within the window, or the rest of the wait is lost too
            end = time.perf_counter()
            stall = launcher.stalled(medians[-1]) + (t1 - t0) + (t3 - t2) + (end - t4)
            clean.append(clean_rate())
            rate = (clean[-2] + clean[-1]) / 2
            lost.append((end - t0) - n / rate)
            stalled.append(stall - (end - t0) * (clean_stall[-2] + clean_stall[-1]) / 2)
            saves.append(t1 - t0)
            waited.append(t3 - t2)
        cpu: list[float] = []
        cpu_saves: list[float] = []
        for _ in range(n_cpu):
            step += 1
            warm_state()
            c0 = cpu_now()
            t0 = time.perf_counter()
            peer.save(state, step)
            cpu_saves.append(time.perf_counter() - t0)
            peer.before_optimizer_step()
            peer.flush()
            cpu.append(cpu_now() - c0)
        peer.close()
    return {"peer": name, "nbytes": nbytes, "tensors": tensors, "lost_ms": [x * 1e3 for x in lost],
            "stalled_ms": [x * 1e3 for x in stalled],
            "save_ms": [x * 1e3 for x in saves + cpu_saves], "waited_ms": [x * 1e3 for x in waited],
            "cpu_s": cpu, "cpu_s_per_gb": [c / (nbytes / 1e9) for c in cpu], "first_s": first_s,
            "clean_iter_per_s": clean, "window_s": window, "step_ms": step_ms, "touch": touch}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per peer, pooled over its runs: medians of time lost, CPU-s per GB, save()."""
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        if "error" in r:
            out.setdefault(r["peer"], {"error": r["error"]})
            continue
        s = out.setdefault(r["peer"], {"lost_ms": [], "stalled_ms": [], "cpu_s": [], "cpu_s_per_gb": [], "save_ms": [],
                                       "waited_ms": [], "first_s": [], "nbytes": r["nbytes"],
                                       "tensors": r["tensors"]})
        s.pop("error", None)
        for k in ("lost_ms", "stalled_ms", "cpu_s", "cpu_s_per_gb", "save_ms", "waited_ms"):
            s[k].extend(r.get(k, []))
        s["first_s"].append(r["first_s"])
    for s in out.values():
        if "error" not in s:
            s["median"] = {k: _median(s[k]) for k in ("lost_ms", "stalled_ms", "cpu_s", "cpu_s_per_gb", "save_ms",
                                                      "waited_ms", "first_s")}
            s["range"] = {k: [min(s[k]), max(s[k])] if s[k] else [0.0, 0.0]
                          for k in ("lost_ms", "stalled_ms", "cpu_s_per_gb", "save_ms")}
    return out


def markdown(summary: dict[str, dict[str, Any]], command: str, machine: str, gil: dict[str, Any] | None = None
             ) -> str:
    """The BENCHMARKS.md section; ``gil``: ``benchmarks.gilcalls``'s JSON (the GIL hand-overs), when given."""
    rows = []
    for name, s in summary.items():
        if "error" in s:
            rows.append(f"| {name} | failed: {s['error'][:80]} | | | | |")
            continue
        m, r = s["median"], s["range"]
        rows.append(f"| {name} | **{m['lost_ms']:.0f}** ({r['lost_ms'][0]:.0f}..{r['lost_ms'][1]:.0f}) "
                    f"| **{m['stalled_ms']:.0f}** ({r['stalled_ms'][0]:.0f}..{r['stalled_ms'][1]:.0f}) "
                    f"| **{m['cpu_s_per_gb']:.2f}** ({r['cpu_s_per_gb'][0]:.2f}..{r['cpu_s_per_gb'][1]:.2f}); "
                    f"{m['cpu_s']:.2f} CPU-s a checkpoint | {m['save_ms']:.1f} ({r['save_ms'][0]:.1f}.."
                    f"{r['save_ms'][1]:.1f}) | {m['waited_ms']:.0f} |")
    fast = summary.get("fastckpt", {}).get("median")
    best = min((s["median"]["lost_ms"] for n, s in summary.items()
                if "median" in s and not n.startswith("fastckpt") and n != "torch_save"), default=None)
    calm = min((s["median"]["stalled_ms"] for n, s in summary.items()
                if "median" in s and s["median"].get("stalled_ms") is not None and not n.startswith("fastckpt")
                and n != "torch_save"), default=None)
    verdict = ""
    if fast and best:
        verdict = (f"\n\nfastckpt loses {fast['lost_ms']:.0f} ms per checkpoint, {fast['lost_ms'] / best:.2f}x of the "
                   f"best peer's {best:.0f} ms")
        if calm and fast.get("stalled_ms") is not None:
            verdict += (f"; stalled {fast['stalled_ms']:.0f} ms, {fast['stalled_ms'] / calm:.2f}x of the least "
                        f"stalled peer's {calm:.0f} ms")
        verdict += f"; {fast['cpu_s_per_gb']:.2f} CPU-s per GB; save() {fast['save_ms']:.1f} ms (median)."
    if gil and gil.get("per_checkpoint"):
        row = gil["per_checkpoint"][-1]
        background = sum(v for k, v in row.items() if not k.startswith("save()"))
        verdict += (f"\n\nGIL hand-overs a checkpoint (`python -m benchmarks.gilcalls`): the background threads "
                    f"{background} ({', '.join(f'{k} {v}' for k, v in row.items() if not k.startswith('save()'))}); "
                    f"save() itself releases the GIL {row.get('save() (training thread)', 0)} times.")
    nb = next((s["nbytes"] for s in summary.values() if "nbytes" in s), 0)
    nt = next((s["tensors"] for s in summary.values() if "tensors" in s), 0)
    return "\n".join([
        HEADING, "",
        f"`{command}` ({machine}). W1: {nb / 1e9:.2f} GB of state in {nt} tensors. The training thread launches "
        "tiny ops on one CPU (as a GPU job's Python thread does); **time lost** is what one checkpoint cost it "
        "(the launches it missed against the clean windows on either side), **stalled** the time its iterations "
        "waited beyond three clean medians (for the GIL or its CPU; save(), waits and the flush included; the "
        "clean windows' own rate taken off), **CPU-s** the CPU time of one "
        "checkpoint from save() to durable, this process and its children, with the training thread idle. "
        "Medians over every run (range).", "",
        "| peer | time lost per checkpoint, ms | stalled per checkpoint, ms | CPU-s per GB | save(), ms "
        "| waited before the optimizer step, ms |",
        "|---|---|---|---|---|---|", *rows]) + verdict + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--n-ckpt", type=int, default=5)
    ap.add_argument("--n-cpu", type=int, default=3)
    ap.add_argument("--window", type=float, default=4.0, help="seconds per window (clean and checkpointed)")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="launches before a host-side wait for staging (0: no host wait, as on a GPU)")
    ap.add_argument("--quick", action="store_true", help="the tiny model: a smoke run of seconds")
    ap.add_argument("--touch", action="store_true",
                    help="rewrite the state in place (untimed) before each save, as an optimizer step would")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "launchbound.json")
    ap.add_argument("--into", type=Path, default=None, help="merge the section into this report (BENCHMARKS.md)")
    ap.add_argument("--gil", type=Path, default=None, help="benchmarks.gilcalls --json output to quote")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this peer here, print JSON
    args = ap.parse_args(argv)
    if args.one:
        try:
            res = measure(args.one, args.n_ckpt, args.n_cpu, args.window, args.step_ms, args.quick, args.touch)
        except Exception as e:  # noqa: BLE001 - reported as the peer's row
            res = {"peer": args.one, "error": f"{type(e).__name__}: {e}"}
        print("RESULT " + json.dumps(res))
        return 0
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for name in args.peers.split(","):
            cmd = [sys.executable, "-m", "benchmarks.launchbound", "--one", name, "--n-ckpt", str(args.n_ckpt),
                   "--n-cpu", str(args.n_cpu), "--window", str(args.window), "--step-ms", str(args.step_ms)]
            if args.quick:
                cmd.append("--quick")
            if args.touch:
                cmd.append("--touch")
            out = subprocess.run(cmd, cwd=REPO, env=repo_env(), capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else {"peer": name, "error": (out.stderr or "no result")[-300:]}
            res["round"] = rnd
            runs.append(res)
            brief = ("error: " + res["error"]) if "error" in res else (
                f"lost {statistics.median(res['lost_ms']):.0f} ms, {statistics.median(res['cpu_s_per_gb']):.2f} "
                f"CPU-s/GB, save() {statistics.median(res['save_ms']):.1f} ms")
            print(f"[round {rnd + 1}] {name}: {brief}", flush=True)
    summary = summarize(runs)
    from .report import machine_line

    command = "python -m benchmarks.launchbound " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = {"runs": runs, "summary": summary, "command": command.strip(), "machine": machine_line()}
    args.json.write_text(json.dumps(doc, indent=1))
    section = markdown(summary, doc["command"], doc["machine"],
                       json.loads(args.gil.read_text()) if args.gil else None)
    print(section)
    if args.into is not None:
        from .gpu_report import merge

        args.into.write_text(merge(args.into.read_text(), section, HEADING))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
