"""Where one checkpoint's CPU time goes, per thread and per phase: ``python -m benchmarks.cpu_breakdown [--quick]
[--n N] [--perf N] [--health on,off] [--mode hurried,unhurried] [--root DIR] [--json PATH]``.

W1 (benchmarks/workload.py: the GPT-2-small shape + AdamW, 1.48 GB, 580 tensors), fastckpt with its defaults
(``--health off``: ``health.enabled: false``), saved after a prewarm and a warm-up save, each checkpoint from
``save()`` to durable as ``benchmarks.launchbound`` measures it: ``hurried`` waits for staging right after
``save()`` (launchbound's CPU figure: the copy thread then stages the rest plainly and the I/O workers checksum and
measure), ``unhurried`` only once the copy thread is done (``SaveHandle.wait_copied``: the copy thread's one pass
does it all). Medians over ``--n`` checkpoints of:

- **CPU-s per GB**: this process and its children (``RUSAGE_SELF`` + ``RUSAGE_CHILDREN`` + live children, as
  launchbound), per GB of state;
- **per thread kind**: each thread's on-CPU time (``/proc/self/task/<tid>/schedstat``, ns) by its Python name
  (``fastckpt-copy``, ``-io``, ``-commit``, ``-boost``, the training thread ``main``; ``native``: threads Python
  does not know, torch's intra-op pool).

Then, where ``perf`` runs (``--perf N`` more checkpoints, 0: none), **per phase**: ``perf record -e cpu-clock -g``
on this process (perf's own CPU is not in the figures above: those checkpoints run without it), each sample
classed by the function it hit and, in the kernel, the system call it serves: ``copy`` (torch's copy kernels,
``memmove``), ``crc32c``, ``crc32 (zip)``, ``health reductions`` (torch's reduction kernels: the groups' max, min
and norms, the segment reductions), ``torch other``, ``xxhash`` (fingerprints, content records), ``python`` (the
interpreter: per-piece and per-tensor Python), ``write syscalls`` (a buffered write's kernel copy, O_DIRECT's page
pinning), ``fsync``, ``page faults``, ``kernel other``; per thread kind too. Nothing in fastckpt is patched.

CPU time is steadier than wall time on a busy host, not immune to it (neighbours share the memory bus and the
last-level cache): the load average is printed beside each figure, compare configurations measured together. The
root is a temporary folder under ``--root`` (default: ``$LAUNCHBOUND_DIR`` or the system's temp folder,
launchbound's); its file system is printed (tmpfs and overlayfs refuse O_DIRECT: shards are then written through
the page cache, a kernel copy per byte).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from .launchbound import cpu_now

__all__ = ["thread_cpu", "fs_type", "classify", "perf_phases", "measure", "main"]

_COPY = ("copy_kernel", "__memmove", "__memcpy", "memcpy", "memmove")
_REDUCE = ("reduce", "Reduce", "norm", "Norm", "MaxOps", "MinOps", "max_kernel", "min_kernel", "segment")


def thread_kinds() -> dict[int, str]:
    """Thread id -> kind, for every thread of this process Python knows."""
    main_id = threading.main_thread().native_id
    out = {}
    for t in threading.enumerate():
        if t.native_id == main_id:
            out[t.native_id] = "main"
        elif t.name.startswith("fastckpt-"):
            out[t.native_id] = "-".join(t.name.split("-")[:2])
        else:
            out[t.native_id] = "other"
    return out  # type: ignore[return-value]


def thread_cpu() -> dict[str, float]:
    """On-CPU seconds of every thread of this process so far (schedstat, ns), summed by thread kind."""
    kinds = thread_kinds()
    out: dict[str, float] = defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
        except OSError:
            continue  # ended meanwhile
        out[kinds.get(int(tid), "native")] += ns / 1e9
    return out


def fs_type(path: str) -> str:
    """The type of the file system ``path`` is on (the longest mount point above it in /proc/self/mounts)."""
    best, kind = "", "?"
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def classify(frames: list[tuple[str, str]]) -> str:
    """The phase of one perf sample: ``frames`` are (symbol, dso), the leaf first."""
    sym, dso = frames[0]
    if "kernel" in dso:
        names = " ".join(s for s, d in frames if "kernel" in d)
        if "fsync" in names:
            return "fsync"
        if "sys_write" in names or "sys_pwrite" in names or "do_iter_write" in names or "vfs_write" in names:
            return "write syscalls"
        if "page_fault" in names:
            return "page faults"
        return "kernel other"
    if "_crc32c" in dso:
        return "crc32c"
    if "zlib_ng" in dso or "libz" in dso:
        return "crc32 (zip)"
    if "xxhash" in dso:
        return "xxhash"
    if any(k in sym for k in _COPY):
        return "copy"
    if "torch" in dso or "c10" in dso or "gomp" in dso:
        return "health reductions" if any(k in sym for k in _REDUCE) else "torch other"
    if "python" in dso:
        return "python"
    if "libc" in dso:
        return "libc other"
    return os.path.basename(dso) or "?"


def _parse(script: str) -> list[tuple[int, list[tuple[str, str]]]]:
    """``perf script -F tid,ip,sym,dso`` (with call chains) as (tid, frames) per sample."""
    out: list[tuple[int, list[tuple[str, str]]]] = []
    tid, frames = None, []
    for line in script.splitlines():
        if not line.strip():
            if tid is not None and frames:
                out.append((tid, frames))
            tid, frames = None, []
        elif not line[0].isspace():
            tid, frames = int(line.split()[0]), []
        else:
            parts = line.split(None, 1)
            rest = parts[1] if len(parts) > 1 else ""
            sym, _, dso = rest.rpartition(" (")
            frames.append((sym, dso.rstrip(")")))
    if tid is not None and frames:
        out.append((tid, frames))
    return out


class PerfRecorder:
    """``perf record -e cpu-clock -g`` on this process between ``start`` and ``stop``."""

    def __init__(self, out: str, freq: int = 999) -> None:
        self.out, self.freq = out, freq
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(self.freq), "-g",
                                      "-p", str(os.getpid()), "-o", self.out],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)  # perf attaches to every thread before the measured save starts

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)
        self.proc.communicate(timeout=60)


def perf_phases(data: str, kinds: dict[int, str], freq: int) -> dict[str, dict[str, float]]:
    """CPU seconds by thread kind and phase from a perf data file."""
    script = subprocess.run(["perf", "script", "-i", data, "-F", "tid,ip,sym,dso"], capture_output=True,
                            text=True, check=True).stdout
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for tid, frames in _parse(script):
        out[kinds.get(tid, "native")][classify(frames)] += 1.0 / freq
    return {k: dict(v) for k, v in out.items()}


def measure(health: bool, hurried: bool, n: int, n_perf: int, quick: bool, root: str | None) -> dict[str, Any]:
    """``n`` checkpoints of W1 (``quick``: the tiny model) with health on or off, each to durable, then ``n_perf``
    under perf."""
    import torch

    from fastckpt import CheckpointConfig, Checkpointer

    from .workload import FULL, QUICK, Batches, build, make_state, tensor_bytes, train_step

    torch.set_num_threads(1)  # as launchbound's and the harness's training thread
    shape = QUICK if quick else FULL
    torch.manual_seed(0)
    model, opt = build(shape)
    train_step(model, opt, Batches(shape))
    state = make_state(model, opt, 0)
    nbytes = tensor_bytes(state)
    gb = nbytes / 1e9
    rows: list[dict[str, Any]] = []
    where = root or os.environ.get("LAUNCHBOUND_DIR") or tempfile.gettempdir()
    perf_by: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="cpu-breakdown-", dir=where) as d:
        ckpt = Checkpointer(CheckpointConfig(root=d, **({} if health else {"health": {"enabled": False}})))
        ckpt.watch(opt)
        ckpt.prewarm(state).result()

        def one(step: int) -> None:
            handle = ckpt.save(state, step)
            if hurried:
                ckpt.wait_staged()
            else:
                handle.wait_copied()
            ckpt.wait()

        try:
            one(0)  # the warm-up
            load = os.getloadavg()[0]
            for step in range(1, n + 1):
                c0, t0, w0 = cpu_now(), thread_cpu(), time.perf_counter()
                one(step)
                wall = time.perf_counter() - w0
                cpu, t1 = cpu_now() - c0, thread_cpu()
                rows.append({"cpu_s": cpu, "wall_s": wall,
                             "threads": {k: t1.get(k, 0.0) - t0.get(k, 0.0) for k in t1}})
            if n_perf and shutil.which("perf"):
                data = os.path.join(d, "perf.data")
                rec = PerfRecorder(data)
                rec.start()
                try:
                    for step in range(n + 1, n + 1 + n_perf):
                        one(step)
                finally:
                    rec.stop()
                perf_by = {k: {p: s / n_perf / gb for p, s in v.items()}
                           for k, v in perf_phases(data, thread_kinds(), rec.freq).items()}
            load = (load + os.getloadavg()[0]) / 2
        finally:
            ckpt.close()
    kinds = sorted({k for r in rows for k in r["threads"]})
    phases: dict[str, float] = defaultdict(float)
    for by in perf_by.values():
        for p, v in by.items():
            phases[p] += v
    return {
        "health": health, "mode": "hurried" if hurried else "unhurried", "nbytes": nbytes, "n": n,
        "root": where, "fs": fs_type(where), "loadavg": load,
        "cpu_s_per_gb": statistics.median(r["cpu_s"] for r in rows) / gb,
        "cpu_s_per_gb_all": [r["cpu_s"] / gb for r in rows],
        "wall_s": statistics.median(r["wall_s"] for r in rows),
        "threads_s_per_gb": {k: statistics.median(r["threads"].get(k, 0.0) for r in rows) / gb for k in kinds},
        "phases_s_per_gb": dict(phases), "phases_by_thread": perf_by,
    }


def report(res: dict[str, Any]) -> str:
    def row(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.3f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 5e-4)

    lines = [f"health {'on' if res['health'] else 'off'}, {res['mode']}: {res['cpu_s_per_gb']:.3f} CPU-s/GB "
             f"({', '.join(f'{x:.3f}' for x in res['cpu_s_per_gb_all'])}), wall {res['wall_s']:.2f} s, "
             f"root {res['root']} ({res['fs']}), load {res['loadavg']:.2f}",
             "  threads: " + row(res["threads_s_per_gb"])]
    if res["phases_s_per_gb"]:
        lines.append("  phases (perf):  " + row(res["phases_s_per_gb"]))
        for kind, by in sorted(res["phases_by_thread"].items()):
            lines.append(f"    {kind}: " + row(by))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=3, help="timed checkpoints per configuration (after a warm-up)")
    ap.add_argument("--perf", type=int, default=2, help="checkpoints under perf for the phases (0: none)")
    ap.add_argument("--health", default="on,off")
    ap.add_argument("--mode", default="hurried,unhurried")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--root", default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    out = []
    for h in args.health.split(","):
        for m in args.mode.split(","):
            res = measure(h == "on", m == "hurried", args.n, args.perf, args.quick, args.root)
            print(report(res), flush=True)
            out.append(res)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
