"""Where the stall goes: ``python -m benchmarks.run --only breakdown`` (BENCHMARKS.md, "Where the stall goes").

The plain loop of ``measure.task_core`` with fastckpt only, interleaved clean and checkpointed windows at the
calibrated short step, and per window what the training thread lost, split by cause:

- ``cpu``: the training thread's own CPU time (``time.thread_time``). It grows when the copy, the checksums and
  the writes share the memory bus and the caches with the step (memory-bandwidth contention).
- ``runq``: time the training thread was runnable but not running (``/proc/self/task/<tid>/schedstat``,
  field 2): background threads holding the cores.
- ``offcpu``: the rest of the wall time, ``wall - cpu - runq``: time the thread slept. That is the wait for
  staging at the optimizer's step (fastckpt's ``waited_ms``, reported apart) plus waits to re-take the GIL
  (every torch op releases and re-takes it) and page faults that block, plus the ``wait()`` that closes a
  checkpointed window. ``gil`` = ``offcpu`` minus the staging wait and that ``wait()``. A cross-check: a pure-Python
  probe loop (about 1 ms) before each step, timed: its wall minus its CPU minus its run-queue delay is time spent
  waiting for the GIL. It sees a wait only when another thread takes the GIL from it (after the 5 ms switch
  interval, longer than the probe), so it bounds the GIL hold time of the background threads' Python code rather
  than the training thread's waits after each torch op, which ``gil`` counts.

Per window also: the background threads' CPU time by name (``/proc/self/task/*/stat`` utime + stime; fastckpt's
threads are ``fastckpt-copy-*``, ``-io-*``, ``-commit-*``, ``-boost-*``), and page-cache writeback
(``/proc/meminfo`` Dirty + Writeback, its peak sampled at step boundaries, and ``/proc/vmstat`` nr_dirtied /
nr_written). Once per process: the floor, one memcpy of the state (``torch`` ``copy_`` into a preallocated
buffer) and one CRC32C pass over it, so the bytes moved per checkpoint can be read in passes over the state.

Each configuration (``CONFIGS``) runs in its own process (``run.py``), several times, so the machine's noise is
stated beside each figure.
"""
from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from . import workload as wl
from .measure import Trainer, floor, paired_stall, rmtree

__all__ = ["CONFIGS", "task_breakdown"]

# name -> CheckpointConfig overrides (sections as mappings). "default" is the release's behaviour (health + CRC32C in
# the copy thread's one pass, persist.priority normal); "priority idle" the default before 2026-11-26 (I/O and commit
# threads under SCHED_IDLE); "no gate" the default before the CPU gate; "no_health" the bound of what a cheaper
# health pass could give. Earlier runs measured "single_pass" (staging.crc_in_copy, the CRC alone then) and write
# pacing (persist.pace_writes): no gain (BENCHMARKS.md); with the health statistics in it the one pass is the default.
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "priority idle": {"persist": {"priority": "idle"}},
    "no_health": {"health": {"enabled": False}},
    # the release before 2026-11-30's one pass (staging.crc_in_copy: true, the CRC32C and health statistics taken
    # by the copy thread): the I/O workers read the staged bytes again for both
    "two passes": {"staging": {"crc_in_copy": False}},
    # the release before 2026-11-26's CPU gate (persist.cpu_threads: auto): every background thread's CPU work at once
    "no gate": {"persist": {"cpu_threads": 64}},
    # the release before 2026-11-29's placement (persist.background_cpus: auto): the background threads on any core
    "no pin": {"persist": {"background_cpus": "all"}},
}

_TICK = os.sysconf("SC_CLK_TCK")
_PROBE_ITERS = 20_000


def _schedstat(tid: int) -> int:
    """Run-queue delay of thread ``tid`` so far, ns (schedstat field 2)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[1])


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (utime + stime) of every thread of this process, summed by name family (Python's thread names:
    the kernel's names are the interpreter's, which ``threading`` does not set)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                raw = f.read()
        except OSError:
            continue  # ended meanwhile
        name = names.get(int(tid), raw[raw.index("(") + 1: raw.rindex(")")])
        fields = raw[raw.rindex(")") + 2:].split()
        cpu = (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15 of stat)
        family = "-".join(name.split("-")[:2]) if name.startswith("fastckpt-") else "other"
        out[family] = out.get(family, 0.0) + cpu
    return out


def _meminfo_dirty() -> int:
    """Dirty + Writeback bytes of the page cache, host-wide."""
    total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(("Dirty:", "Writeback:")):
                total += int(line.split()[1]) * 1024
    return total


def _vmstat() -> dict[str, int]:
    with open("/proc/vmstat") as f:
        pairs = (line.split() for line in f)
        return {k: int(v) for k, v in pairs if k in ("nr_dirtied", "nr_written")}


def _probe(tid: int) -> tuple[float, float]:
    """A fixed pure-Python loop (it holds the GIL throughout, so waiting is all it can lose to other Python
    threads): returns (GIL wait = wall - CPU - run-queue delay, wall), seconds."""
    q0, c0, t0 = _schedstat(tid), time.thread_time(), time.perf_counter()
    x = 0
    for i in range(_PROBE_ITERS):
        x += i & 7
    wall = time.perf_counter() - t0
    cpu = time.thread_time() - c0
    runq = (_schedstat(tid) - q0) / 1e9
    return max(0.0, wall - cpu - runq), wall


class Window:
    """What one window of steps cost the training thread, by cause (see the module docstring)."""

    def __init__(self, tid: int) -> None:
        self.tid = tid
        self.wall0 = time.perf_counter()
        self.cpu0 = time.thread_time()
        self.q0 = _schedstat(tid)
        self.threads0 = _thread_cpu()
        self.vm0 = _vmstat()
        self.dirty_peak = _meminfo_dirty()
        self.probe_gil = 0.0
        self.probe_wall = 0.0
        self.save_s = 0.0  # inside save() (state_dict and save() itself, on the training thread)
        self.flush_s = 0.0  # the wait() that ends a checkpointed window (what the next save would wait for)

    def step(self, tr: Trainer) -> None:
        gil, wall = _probe(self.tid)
        self.probe_gil += gil
        self.probe_wall += wall
        tr.step()
        self.dirty_peak = max(self.dirty_peak, _meminfo_dirty())

    def end(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.wall0
        cpu = time.thread_time() - self.cpu0
        runq = (_schedstat(self.tid) - self.q0) / 1e9
        t1 = _thread_cpu()
        vm1 = _vmstat()
        page = os.sysconf("SC_PAGE_SIZE")
        return {
            "wall_s": wall, "cpu_s": cpu, "runq_s": runq, "offcpu_s": wall - cpu - runq,
            "probe_gil_s": self.probe_gil, "probe_wall_s": self.probe_wall,
            "save_s": self.save_s, "flush_s": self.flush_s,
            "threads_cpu_s": {k: v - self.threads0.get(k, 0.0) for k, v in t1.items() if k != "other"},
            "dirty_peak_bytes": self.dirty_peak,
            "dirtied_bytes": (vm1["nr_dirtied"] - self.vm0["nr_dirtied"]) * page,
            "written_bytes": (vm1["nr_written"] - self.vm0["nr_written"]) * page,
        }


def _sum(windows: list[dict[str, Any]], key: str) -> list[float]:
    return [w[key] for w in windows]


def task_breakdown(config: str, shape: dict, root: str, warmup: int, every: int, n_ckpt: int) -> dict[str, Any]:
    """One configuration's breakdown: interleaved clean/checkpointed windows of ``every`` steps (``n_ckpt`` of
    the latter), per window the causes above; per checkpoint the paired difference of each cause."""
    from fastckpt import CheckpointConfig, Checkpointer

    root_p = Path(root)
    rmtree(root_p)
    wl.tune_malloc()
    tr = Trainer(wl.Shape(**shape))
    overrides = CONFIGS[config]
    ck = Checkpointer(CheckpointConfig.from_dict({"root": os.fspath(root_p), **overrides}))
    ck.watch(tr.opt)
    tid = threading.get_native_id()
    tr.timed_steps(warmup)
    state = tr.state(0)
    state_bytes = wl.tensor_bytes(state)
    fl = floor(wl.unique_tensors(state))
    del state
    gc.collect()
    ck.save(tr.state(0), 0)  # warm-up: plan, allocation, first touch of the staging buffers
    tr.step()
    ck.wait()
    tr.timed_steps(warmup)
    clean: list[dict[str, Any]] = []
    ckpt: list[dict[str, Any]] = []
    step = 1
    for w in range(2 * n_ckpt + 1):
        win = Window(tid)
        if w % 2:
            t0 = time.perf_counter()
            ck.save(tr.state(step), step)
            win.save_s = time.perf_counter() - t0
        for _ in range(every):
            win.step(tr)
        if w % 2:
            t0 = time.perf_counter()
            ck.wait()  # what the next save would wait for: part of the window, as in the plain loop
            win.flush_s = time.perf_counter() - t0
        (ckpt if w % 2 else clean).append(win.end())
        step += every
    stats = ck.stats[1:]
    ck.close()
    rmtree(root_p)

    def paired(key: str) -> float:
        cw = [w[key] for w in ckpt]
        cl = [w[key] for w in clean]
        diffs = [c - (cl[i] + cl[i + 1]) / 2 for i, c in enumerate(cw)]
        return statistics.median(diffs)

    waited = statistics.median([s.waited_ms / 1e3 for s in stats])
    families = sorted({k for w in ckpt for k in w["threads_cpu_s"]})
    out = {
        "config": config, "overrides": overrides, "every": every, "n_ckpt": n_ckpt, "state_bytes": state_bytes,
        "step_s": statistics.median([w["wall_s"] / every for w in clean]),
        **fl,
        "stall": paired_stall(_sum(ckpt, "wall_s"), _sum(clean, "wall_s")),
        "d_cpu_s": paired("cpu_s"), "d_runq_s": paired("runq_s"), "d_offcpu_s": paired("offcpu_s"),
        "waited_s": waited, "d_probe_gil_s": paired("probe_gil_s"),
        "save_s": statistics.median(_sum(ckpt, "save_s")), "flush_s": statistics.median(_sum(ckpt, "flush_s")),
        "bg_cpu_s": {f: statistics.median([w["threads_cpu_s"].get(f, 0.0) for w in ckpt]) for f in families},
        "dirty_peak_bytes": max(w["dirty_peak_bytes"] for w in ckpt),
        "dirtied_bytes": statistics.median(_sum(ckpt, "dirtied_bytes")),
        "written_bytes": statistics.median(_sum(ckpt, "written_bytes")),
        "staging_ms": statistics.median([s.staging_ms for s in stats]),
        "persist_s": statistics.median([s.persist_s for s in stats]),
        "clean": clean, "ckpt": ckpt,
    }
    # the window's closing wait() sleeps too (clean windows have none): what is left is GIL waits and blocking faults
    out["d_gil_s"] = out["d_offcpu_s"] - waited - out["flush_s"]
    return out
