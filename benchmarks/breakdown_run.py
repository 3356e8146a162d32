"""``python -m benchmarks.run --only breakdown [--quick]``: run ``benchmarks.breakdown`` for each configuration,
``REPS`` times interleaved (a shared machine drifts), and write the section "Where the stall goes" into the report
(BENCHMARKS.md; every other section is left as it is) plus ``benchmarks/breakdown.json``."""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable

from .breakdown import CONFIGS

__all__ = ["HEADING", "REPS", "markdown", "run_breakdown"]

HEADING = "## Where the stall goes"
REPS = 3


def run_breakdown(run: Callable[[str, str, dict[str, Any]], dict[str, Any]], shape: dict, ck: str, warmup: int,
                  every: int, n_ckpt: int, reps: int = REPS) -> dict[str, Any]:
    """Every configuration ``reps`` times, round-robin; each run in its own worker process."""
    out: dict[str, Any] = {"every": every, "n_ckpt": n_ckpt, "reps": reps, "runs": {c: [] for c in CONFIGS}}
    for r in range(reps):
        for cfg in CONFIGS:
            res = run(f"breakdown: {cfg} #{r + 1}", "breakdown",
                      dict(config=cfg, shape=shape, root=ck, warmup=warmup, every=every, n_ckpt=n_ckpt))
            out["runs"][cfg].append(res)
    return out


def _spread(xs: list[float], scale: float = 1e3, unit: str = "ms") -> str:
    if not xs:
        return "n/a"
    m = statistics.median(xs) * scale
    lo, hi = min(xs) * scale, max(xs) * scale
    return f"{m:.0f} {unit} ({lo:.0f}..{hi:.0f})" if len(xs) > 1 else f"{m:.0f} {unit}"


def markdown(res: dict[str, Any], command: str, machine: str) -> str:
    """The section: per configuration the median over runs of each per-checkpoint figure, with its range."""
    rows: list[tuple[str, Callable[[dict[str, Any]], float], float, str]] = [
        ("stall per checkpoint (paired windows)", lambda r: r["stall"]["stall_s"], 1e3, "ms"),
        ("  inside save() (with state_dict())", lambda r: r["save_s"], 1e3, "ms"),
        ("  training thread CPU time, +", lambda r: r["d_cpu_s"], 1e3, "ms"),
        ("  run-queue delay, +", lambda r: r["d_runq_s"], 1e3, "ms"),
        ("  off-CPU (sleeping), +", lambda r: r["d_offcpu_s"], 1e3, "ms"),
        ("    of which the wait() at the window's end (persisting)", lambda r: r["flush_s"], 1e3, "ms"),
        ("    of which the wait for staging at the step", lambda r: r["waited_s"], 1e3, "ms"),
        ("    of which GIL waits and blocking faults (rest)", lambda r: r["d_offcpu_s"] - r["waited_s"] - r["flush_s"],
         1e3, "ms"),
        ("  GIL probe (pure-Python loop before each step), +", lambda r: r["d_probe_gil_s"], 1e3, "ms"),
        ("fastckpt-copy CPU", lambda r: r["bg_cpu_s"].get("fastckpt-copy", 0.0), 1e3, "ms"),
        ("fastckpt-io CPU", lambda r: r["bg_cpu_s"].get("fastckpt-io", 0.0), 1e3, "ms"),
        ("fastckpt-commit CPU", lambda r: r["bg_cpu_s"].get("fastckpt-commit", 0.0), 1e3, "ms"),
        ("staging (copy thread) time", lambda r: r["staging_ms"] / 1e3, 1e3, "ms"),
        ("save() to durable (persist_s)", lambda r: r["persist_s"], 1e3, "ms"),
        ("page cache dirtied in the window", lambda r: r["dirtied_bytes"], 1e-6, "MB"),
        ("peak Dirty+Writeback", lambda r: r["dirty_peak_bytes"], 1e-6, "MB"),
    ]
    cfgs = [c for c in CONFIGS if any(x.get("ok") for x in res["runs"].get(c, []))]
    ok = {c: [x["result"] for x in res["runs"][c] if x.get("ok")] for c in cfgs}
    first = next((v[0] for v in ok.values() if v), None)
    lines = [HEADING, ""]
    if first is None:
        failed = [x.get("error") for c in res["runs"] for x in res["runs"][c]]
        return "\n".join(lines + [f"No run completed: {failed[:2]}", ""])
    lines += [
        f"Reproduce: `{command}` ({machine}). The plain loop (fastckpt only) at the calibrated step of "
        f"{first['step_s']:.2f} s, a checkpoint every {res['every']} steps ({first['state_bytes'] / 1e9:.2f} GB of "
        f"state), {res['n_ckpt']} checkpointed windows between clean ones per run, {res['reps']} runs per "
        "configuration interleaved; each cell is the median over runs of the per-run median per checkpoint, with "
        "the runs' range (the noise) in brackets. Method: benchmarks/breakdown.py's docstring.",
        "",
        f"Floor: one memcpy of the state (`copy_` into preallocated buffers) "
        f"{_spread([r['memcpy_s'] for v in ok.values() for r in v])}, one CRC32C pass over it "
        f"{_spread([r['crc_s'] for v in ok.values() for r in v])}.",
        "",
        "| per checkpoint | " + " | ".join(f"`{c}`" for c in cfgs) + " |",
        "|---|" + "---|" * len(cfgs),
    ]
    for label, get, scale, unit in rows:
        cells = [_spread([get(r) for r in ok[c]], scale, unit) for c in cfgs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines) + "\n"


def write(res: dict[str, Any], out: Path, json_path: Path, command: str, machine: str) -> None:
    """Save the raw results and put the section into ``out`` (replacing an older one)."""
    from .gpu_report import merge

    json_path.write_text(json.dumps(res, indent=1))
    old = out.read_text() if out.exists() else ""
    out.write_text(merge(old, markdown(res, command, machine), HEADING))
