"""Where a checkpoint's stall of the launch-bound training thread goes, by time and by cause:
``python -m benchmarks.stallwhere [--peer fastckpt] [--n-ckpt N] [--window S] [--config JSON] [--json PATH]``.

benchmarks/launchbound.py gives one figure per checkpoint (**stalled**: the time the launching thread's iterations
waited beyond three clean medians). This splits it, in one process, for one peer (W1, as there):

- **by time**: the stalled seconds inside ``save()``, in each 100 ms after it returned, and in the flush at the
  window's end; for fastckpt also by phase: until the lazy copy was staged (``SaveStats.staging_ms``), from there to
  the end of the launches (the checksums, writes and commit not yet done), and the flush;
- **by cause**, from the kernel's per-thread counters of the launching thread (``/proc/self/task/<tid>``): the time
  it was runnable but waited for a CPU (``schedstat``'s run delay: another thread or process on its CPU) and the
  number of times it went to sleep (voluntary context switches: in this process, a wait for the GIL held by another
  thread, or a lock) or was preempted (involuntary ones);
- **by thread**: the CPU-seconds each of the process's threads took in the window (``/proc/self/task/<tid>/stat``,
  clock ticks), by name, so a background thread's share of the CPU time shows next to the stall it caused.

Each figure of a checkpointed window has the same figure of the clean windows on either side taken off (per second
of window), so what remains is the checkpoint's. Medians over the ``--n-ckpt`` windows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .launchbound import Launcher, make_peer

__all__ = ["ThreadCounters", "attribute", "main"]

_BIN_S = 0.1  # the width of a time bin after save() returned
_TICK = os.sysconf("SC_CLK_TCK")


class ThreadCounters:
    """The kernel's counters of this process's threads: CPU time per thread (by name), and the run delay and
    context switches of one thread (the launching one)."""

    def __init__(self, tid: int) -> None:
        self.tid = tid

    def cpu_by_name(self) -> dict[str, float]:
        """CPU-seconds of every live thread of this process, summed by thread name."""
        out: dict[str, float] = {}
        names = {t.native_id: t.name for t in threading.enumerate()}  # Python names the OS does not know
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    raw = f.read()
            except OSError:  # the thread exited between the listing and the read
                continue
            name = raw[raw.index("(") + 1: raw.rindex(")")]
            fields = raw[raw.rindex(")") + 2:].split()
            name = "training thread" if int(tid) == self.tid else _family(names.get(int(tid), name))
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        return out

    def mine(self) -> dict[str, float]:
        """The launching thread's run delay (seconds), voluntary and involuntary context switches."""
        with open(f"/proc/self/task/{self.tid}/schedstat") as f:
            _run, delay, _slices = (int(x) for x in f.read().split())
        out = {"run_delay_s": delay / 1e9}
        with open(f"/proc/self/task/{self.tid}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches"):
                    out["sleeps"] = float(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches"):
                    out["preempted"] = float(line.split()[1])
        return out


def _family(name: str) -> str:
    """A thread name without its pool index (``fastckpt-io_3`` -> ``fastckpt-io``): pools pooled."""
    base = name.rstrip("0123456789")
    return base.rstrip("_-") or name


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}


class _Excess:
    """The last run's iterations as (when each ended, its stalled seconds: its excess over ``median`` where slower
    than ``Launcher.SLOW`` medians, else 0), derived once per window; ``between`` sums any interval of them."""

    def __init__(self, launcher: Launcher, median: float, start: float) -> None:
        import numpy as np

        x = launcher.times[:launcher.count]
        self.ends = start + np.cumsum(x)
        self.over = np.where(x > Launcher.SLOW * median, x - median, 0.0)

    def between(self, t_from: float, t_to: float) -> float:
        """Stalled seconds of the iterations that ended in [t_from, t_to)."""
        return float(self.over[(self.ends >= t_from) & (self.ends < t_to)].sum())


def attribute(name: str, n_ckpt: int, window: float, config: dict[str, Any] | None = None, quick: bool = False
              ) -> dict[str, Any]:
    """The attribution of ``name``'s stall, measured here (see the module's docstring). The process's intra-op
    threads and CPU mask are the benchmark's while it runs and the caller's again after (a test calls it in its
    own process, whose later tests must not find one intra-op thread)."""
    import torch

    threads, mask = torch.get_num_threads(), os.sched_getaffinity(0)
    try:
        return _attribute(name, n_ckpt, window, config, quick)
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, mask)


def _attribute(name: str, n_ckpt: int, window: float, config: dict[str, Any] | None, quick: bool) -> dict[str, Any]:
    import torch

    from .workload import FULL, QUICK, Batches, build, make_state, tensor_bytes, train_step

    os.sched_setaffinity(0, {0, 1} & os.sched_getaffinity(0) or os.sched_getaffinity(0))
    torch.set_num_threads(1)
    shape = QUICK if quick else FULL
    model, opt = build(shape)
    train_step(model, opt, Batches(shape))
    state = make_state(model, opt, 0)
    first = sorted(os.sched_getaffinity(0))[0]
    launcher = Launcher(first)
    launcher.run_until(time.perf_counter() + 0.3)
    counters = ThreadCounters(threading.get_native_id())
    with tempfile.TemporaryDirectory(prefix=f"stallwhere-{name}-", dir=os.environ.get("LAUNCHBOUND_DIR")) as root:
        peer = make_peer(name, Path(root))
        if config and hasattr(peer, "inner"):  # fastckpt with other settings: the same adapter, another config
            from fastckpt import CheckpointConfig, Checkpointer

            peer.inner.ckpt.close()
            peer.inner.ckpt = Checkpointer(CheckpointConfig(root=root, **config))
        peer.attach(model, opt)
        if hasattr(peer, "prewarm"):
            peer.prewarm(state)
        step = 1
        t = time.perf_counter()
        peer.save(state, step)
        peer.flush()
        window = max(window, 1.5 * (time.perf_counter() - t) + 1.0)

        def snapshot() -> tuple[dict[str, float], dict[str, float]]:
            return counters.cpu_by_name(), counters.mine()

        clean: list[dict[str, float]] = []  # per second of each clean window: stalled, run delay, switches, CPU

        def clean_window() -> float:
            a = snapshot()
            t0 = time.perf_counter()
            launcher.run_until(t0 + window)
            took = time.perf_counter() - t0
            b = snapshot()
            med = launcher.median()
            row = {"stalled_s": launcher.stalled(med), **_delta(a[1], b[1])}
            row.update({f"cpu:{k}": v for k, v in _delta(a[0], b[0]).items()})
            clean.append({k: v / took for k, v in row.items()})
            return med

        median = clean_window()
        windows: list[dict[str, float]] = []
        for _ in range(n_ckpt):
            step += 1
            a = snapshot()
            t0 = time.perf_counter()
            peer.save(state, step)
            t1 = time.perf_counter()
            launcher.run_until(t0 + window)
            start = t1  # the launcher's first iteration starts right after save() returned
            t4 = time.perf_counter()
            peer.flush()
            end = time.perf_counter()
            b = snapshot()
            stats = getattr(getattr(getattr(peer, "inner", None), "ckpt", None), "stats", None)
            row: dict[str, float] = {"save_s": t1 - t0, "flush_s": end - t4}
            excess = _Excess(launcher, median, start)
            for k in range(int((t4 - t1) / _BIN_S) + 1):
                row[f"bin{k:03d}"] = excess.between(t1 + k * _BIN_S, t1 + (k + 1) * _BIN_S)
            if stats:
                staged = t0 + stats[-1].staging_ms / 1e3
                row["copying_s"] = excess.between(t1, staged)
                row["after_staged_s"] = excess.between(staged, t4 + 1)
                row["staged_at_s"] = staged - t0
                row["durable_at_s"] = stats[-1].persist_s
            row["stalled_s"] = launcher.stalled(median) + row["save_s"] + row["flush_s"]
            row.update(_delta(a[1], b[1]))
            row.update({f"cpu:{k}": v for k, v in _delta(a[0], b[0]).items()})
            span = end - t0
            median_before = median
            median = clean_window()
            per_s = {k: (clean[-2].get(k, 0.0) + clean[-1].get(k, 0.0)) / 2 for k in set(clean[-2]) | set(clean[-1])}
            for k in ("stalled_s", "run_delay_s", "sleeps", "preempted"):
                row[k] -= per_s.get(k, 0.0) * span
            for k in [k for k in row if k.startswith("cpu:")]:
                row[k] -= per_s.get(k, 0.0) * span
            for k in [k for k in row if k.startswith("bin")]:
                row[k] -= per_s.get("stalled_s", 0.0) * _BIN_S
            row["median_iter_us"] = median_before * 1e6
            windows.append(row)
        peer.close()
    keys = sorted({k for w in windows for k in w})
    med = {k: statistics.median(w.get(k, 0.0) for w in windows) for k in keys}
    return {"peer": name, "config": config or {}, "nbytes": tensor_bytes(state), "windows": windows,
            "median": med, "window_s": window}


def markdown(res: dict[str, Any]) -> str:
    """A short report of one ``attribute`` result (milliseconds)."""
    m = res["median"]
    ms = lambda k: f"{m.get(k, 0.0) * 1e3:.0f}"  # noqa: E731
    lines = [f"{res['peer']} {json.dumps(res['config']) if res['config'] else '(defaults)'}: "
             f"{res['nbytes'] / 1e9:.2f} GB, {len(res['windows'])} windows of {res['window_s']:.1f} s, medians "
             "(clean windows' rate taken off)",
             f"- stalled {ms('stalled_s')} ms: save() {ms('save_s')}, flush {ms('flush_s')}"
             + (f", until staged ({m['staged_at_s'] * 1e3:.0f} ms after save()) {ms('copying_s')}, after "
                f"{ms('after_staged_s')} (durable at {m['durable_at_s'] * 1e3:.0f} ms)" if "copying_s" in m else ""),
             "- per 100 ms after save(): " + ", ".join(ms(k) for k in sorted(k for k in m if k.startswith("bin"))),
             f"- the launching thread: waited for a CPU {ms('run_delay_s')} ms, slept {m.get('sleeps', 0):.0f} "
             f"times (GIL or lock waits), preempted {m.get('preempted', 0):.0f} times",
             "- CPU-s of the checkpoint by thread: " + ", ".join(
                 f"{k[4:]} {m[k]:.3f}" for k in sorted((k for k in m if k.startswith("cpu:")), key=lambda k: -m[k])
                 if abs(m[k]) >= 0.005)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", default="fastckpt")
    ap.add_argument("--n-ckpt", type=int, default=5)
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--config", default=None, help="fastckpt: CheckpointConfig fields as JSON")
    ap.add_argument("--quick", action="store_true", help="the tiny model: a smoke run of seconds")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    res = attribute(args.peer, args.n_ckpt, args.window, json.loads(args.config) if args.config else None,
                    args.quick)
    print(markdown(res))
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
