"""Turn raw results into ratios, a target checklist, a PNG bar chart and BENCHMARKS.md."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from . import REPO, frameworks, peers
from .cli import markdown as cli_markdown
from .labels import own_run_label
from .measure import stall_estimate

GB = 1e9


# ---------------------------------------------------------------------------------------------- machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def machine_line(cpu: str | None = None, cpus: int | None = None, load: float | None = None,
                 when: str | None = None) -> str:
    """The machine and the moment, for a section's "Reproduce" line: CPU model, CPUs, load average at the end, time;
    each taken now unless given (a full run passes what it recorded)."""
    cpu = _cpu_model() if cpu is None else cpu
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    load = os.getloadavg()[0] if load is None else load
    return f"{cpu}, {cpus} CPUs, load average at the end {load:.1f}, {when or time.strftime('%Y-%m-%d %H:%M')}"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


def machine_info(workdir: Path, disk: dict[str, str]) -> dict[str, Any]:
    import psutil
    import torch

    from . import workload as wl

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    from importlib import metadata

    for mod in ("lightning", "accelerate", "numpy", "psutil"):
        try:  # distribution metadata, as below: importing Lightning here cost every run (--only io too) 5 s of CPU
            versions[mod] = metadata.version(mod)
        except metadata.PackageNotFoundError:
            versions[mod] = "not installed"
    for dists in (("torchsnapshot-nightly", "torchsnapshot"), ("dlrover",), ("bytecheckpoint",)):
        for dist in dists:  # distribution metadata only: importing these is slow and noisy
            try:
                versions[dist] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
        else:
            versions[dists[-1]] = "not installed"
    usage = psutil.disk_usage(str(workdir))
    return {
        "cpu": _cpu_model(),
        "logical_cpus": psutil.cpu_count(),
        "physical_cpus": psutil.cpu_count(logical=False),
        "ram_gb": psutil.virtual_memory().total / 2**30,
        "kernel": platform.release(),
        "disk": {**disk, "free_gb": usage.free / 2**30},
        "versions": versions,
        # Tracked files only: an untracked file (the run's own log, `nohup ... > LOG` in the tree) is not a change to
        # the code measured, and marked the clean clone of 2026-11-30's run "+ uncommitted changes".
        "git": {"commit": _git("rev-parse", "--short", "HEAD"),
                "dirty": bool(_git("status", "--porcelain", "--untracked-files=no"))},
        "train_threads": wl.TRAIN_THREADS,
        "loadavg_start": os.getloadavg(),
    }


# ---------------------------------------------------------------------------------------------- summary


def _err(res: dict[str, Any] | None) -> str:
    if res is None:
        return "not run"
    if res.get("skipped"):
        return f"skipped: {res['skipped']}"
    return f"n/a (error: {res.get('error', '?')})"


def _fw_rows(section: dict[str, Any], configs: list[str], labels: dict[str, str]) -> list[dict[str, Any]]:
    bases = [b["result"] for b in section.get("baseline", []) if b.get("ok")]
    base_steps = [s for b in bases for s in b["steps_s"]]
    base_peak = max((b["peak_rss"] or 0 for b in bases), default=None)
    rows = []
    for cfg in configs:
        if cfg == "baseline":
            if not bases:
                errs = [b for b in section.get("baseline", []) if not b.get("ok")]
                rows.append({"key": cfg, "label": labels[cfg], "ok": False, "error": _err(errs[0] if errs else None)})
                continue
            rows.append({"key": cfg, "label": labels[cfg], "ok": True, "loop_s": statistics.fmean(b["loop_s"] for b in bases),
                         "n_steps": bases[0]["n_steps"], "n_ckpt": 0, "stall_s": 0.0, "noise_s": 0.0,
                         "flush_s": statistics.fmean(b["flush_s"] for b in bases), "block_s": None,
                         "peak_rss": base_peak, "rss_before": None,
                         "base_step_s": statistics.fmean(base_steps)})
            continue
        res = section.get(cfg)
        if not res or not res.get("ok"):
            rows.append({"key": cfg, "label": labels[cfg], "ok": False, "error": _err(res)})
            continue
        r = res["result"]
        row = {"key": cfg, "label": labels[cfg], "ok": True, "loop_s": r["loop_s"], "n_steps": r["n_steps"],
               "n_ckpt": r["n_ckpt"], "flush_s": r["flush_s"], "block_s": r["save_block_median_s"],
               "peak_rss": r["peak_rss"], "rss_before": base_peak, "bytes_on_disk": r["bytes_on_disk"]}
        if "stall_pairs_s" in r:  # paired windows in the run itself (frameworks.py)
            row.update(stall_s=r["stall_s"], noise_s=r["noise_s"], window_steps=r["window_steps"],
                       pooled=r.get("pooled"))
        elif base_steps and r["n_ckpt"]:  # a results.json from before the windows: whole run vs the baseline's
            row.update(stall_estimate(r["loop_s"], r["n_steps"], base_steps, r["n_ckpt"]))
        else:
            row.update(stall_s=None, noise_s=None)
        rows.append(row)
    return rows


def _busy_row(name: str, label: str, res: dict[str, Any]) -> dict[str, Any]:
    if not res.get("ok"):
        return {"key": name, "label": label, "ok": False, "error": _err(res), "skipped": res.get("skipped")}
    r = res["result"]
    figs = r.get("peer_figures") or {}
    return {"key": name, "label": label, "ok": True, "block_s": r["save_block_median_s"],
            "block_max_s": max(r["save_block_s"]), "stall_s": r["stall_s"], "noise_s": r["noise_s"],
            "flush_s": r["flush_s"], "flush_max_s": max(r["flushes_s"]), "durable_s": r["durable_s"],
            "persist_s": figs.get("persist_s") or [], "base_step_s": r["base_step_mean_s"],
            "state_bytes": r["state_bytes"], "every": r["every"], "n_ckpt": r["n_ckpt"],
            "restore": r.get("restore"), "pooled": r.get("pooled")}


def _busy_rows(busy: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per peer beside the neighbours, then fastckpt's run without them (``quiet``), where measured."""
    rows = [_busy_row(name, peers.LABELS[name], res) for name, res in busy.get("peers", {}).items()]
    if "quiet" in busy:
        rows.append(_busy_row("fastckpt_quiet", "fastckpt, no neighbours (reference)", busy["quiet"]))
    return rows


def _busy_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 27's busy-host acceptance: the time to a durable last checkpoint (a save when the loop ends, then
    its flush) no more than DCP's, and the stall no worse than 2x the same loop's on the quiet host."""
    fast, quiet = _row(rows, "fastckpt"), _row(rows, "fastckpt_quiet")
    dcps = [r for r in rows if r["key"].startswith("dcp") and r["ok"] and r["durable_s"]]
    t = {"name": "Busy host: save at the loop's end -> durable", "target": "fastckpt <= DCP async_save"}
    if not fast or not fast["ok"] or not fast["durable_s"] or not dcps:
        out = [{**t, "measured": "n/a (fastckpt or DCP not measured in the busy scenario)", "met": None}]
    else:
        ref = min(dcps, key=lambda r: statistics.median(r["durable_s"]))  # the faster DCP configuration
        f, d = fast["durable_s"], ref["durable_s"]
        # three-way on the ranges of the repeats: met if even fastckpt's slowest beats DCP's fastest
        met = True if max(f) <= min(d) else False if min(f) > max(d) else None
        out = [{**t, "measured": f"{_s(statistics.median(f))} vs {_s(statistics.median(d))} ({ref['label']}) = "
                                 f"{statistics.median(f) / statistics.median(d):.2f}x", "met": met,
                "note": f"fastckpt {_s(min(f))}..{_s(max(f))}, DCP {_s(min(d))}..{_s(max(d))} over "
                        f"{len(f)} repeats" + ("; inconclusive: the ranges overlap" if met is None else "")}]
    t = {"name": "Busy host: per-checkpoint stall", "target": "<= 2x fastckpt's stall in the same loop, quiet host"}
    if not fast or not fast["ok"] or not quiet or not quiet["ok"]:
        return out + [{**t, "measured": "n/a (the quiet reference was not measured)", "met": None}]
    f, nf, q, nq = fast["stall_s"], fast["noise_s"] or 0.0, quiet["stall_s"], quiet["noise_s"] or 0.0
    met = True if f + nf <= 2 * (q - nq) else False if f - nf > 2 * (q + nq) else None
    note = f"busy ±{_s(nf)}, quiet ±{_s(nq)}" + ("; inconclusive: the noise overlaps the target" if met is None else "")
    return out + [{**t, "measured": f"{_s(f)} vs {_s(q)} quiet", "met": met, "note": note}]


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"meta": results.get("meta", {}), "plan": results.get("plan", {})}
    if "core" in results:
        rows = []
        for name, res in results["core"].items():
            label = peers.LABELS[name]
            if not res.get("ok"):
                rows.append({"key": name, "label": label, "ok": False, "error": _err(res),
                             "skipped": res.get("skipped")})
                continue
            r = res["result"]
            rows.append({"key": name, "label": label, "ok": True, "block_s": r["save_block_median_s"],
                         "block_max_s": max(r["save_block_s"]), "first_block_s": r["first_save_block_s"],
                         "stall_s": r["stall_s"], "noise_s": r["noise_s"], "flush_s": r["flush_s"],
                         "peak_rss": r["peak_rss"], "rss_before": r["rss_before_saves"],
                         "state_bytes": r["state_bytes"], "n_ckpt": r["n_ckpt"], "n_steps": r["n_steps"],
                         "base_step_s": r["base_step_mean_s"], "bytes_per_ckpt": r["bytes_on_disk_per_ckpt"],
                         "figures": r.get("peer_figures") or {}, "stall_mean_s": r.get("stall_mean_s"),
                         "floor": r.get("floor"), "pooled": r.get("pooled"),
                         "restore": r.get("restore")})
        s["core"] = rows
    if "busy" in results:
        s["busy"] = _busy_rows(results["busy"])
    if "io" in results:
        s["io"] = results["io"]["result"] if results["io"].get("ok") else {"error": _err(results["io"])}
    if "rss" in results:
        s["rss"] = results["rss"]["result"] if results["rss"].get("ok") else {"error": _err(results["rss"])}
    if "lightning" in results:
        s["lightning"] = _fw_rows(results["lightning"], frameworks.LIGHTNING_CONFIGS, frameworks.LIGHTNING_LABELS)
    if "lightning_load" in results:
        r = results["lightning_load"]
        s["lightning_load"] = r["result"] if r.get("ok") else {"error": _err(r)}
    if "accelerate" in results:
        s["accelerate"] = _fw_rows(results["accelerate"], frameworks.ACCELERATE_CONFIGS, frameworks.ACCELERATE_LABELS)
    s["cold_best"] = _cold_best(results.get("restore"))
    s["targets"] = targets(s)
    return s


def _cold_best(restore: dict[str, Any] | None) -> dict[str, Any] | None:
    """torch.load's and ``load()``'s best cold times on the workload's files, from the restore section's rounds."""
    cases = ((restore or {}).get("cold") or {}).get("cases") or {}
    loads = [r["result"] for r in (cases.get("workload") or {}).get("loads", []) if r.get("ok")]
    runs = {k: [r["seconds"] for r in loads if r["loader"] == k] for k in ("torch_load", "fastckpt_load")}
    if not all(runs.values()):
        return None
    return {"runs": min(len(v) for v in runs.values()), **{k: min(v) for k, v in runs.items()}}


def _row(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    for r in rows:
        if r["key"] == key:
            return r
    return None


def _stall_target(fast: dict[str, Any] | None, ref: dict[str, Any] | None, factor: float, ref_name: str,
                  name: str) -> dict[str, Any]:
    t = {"name": name, "target": f"fastckpt <= 1/{factor:g} of {ref_name} (<= {1 / factor:.2f}x)"}
    if not fast or not fast.get("ok") or fast.get("stall_s") is None:
        return {**t, "measured": (fast or {}).get("error", "n/a"), "met": None}
    if not ref or not ref.get("ok") or ref.get("stall_s") is None:
        return {**t, "measured": f"reference n/a: {(ref or {}).get('error', 'n/a')}", "met": None}
    f, r = fast["stall_s"], ref["stall_s"]
    ratio = f"= {f / r:.2f}x" if r > 0 else ""
    measured = f"{_s(f)} vs {_s(r)} {ratio}".strip()
    note = ""
    if abs(f) < (fast.get("noise_s") or 0):
        note = f"fastckpt's stall is within noise (±{_s(fast['noise_s'])})"
    if r <= 0:
        return {**t, "measured": measured, "met": None, "note": "reference stall <= 0 (noise)"}
    # Three-way verdict: a point estimate within the noise of either stall decides nothing.
    nf, nr = fast.get("noise_s") or 0.0, ref.get("noise_s") or 0.0
    if f + nf <= (r - nr) / factor:
        met: bool | None = True
    elif f - nf > (r + nr) / factor:
        met = False
    else:
        met = None
        note = (f"inconclusive: the point estimate {'meets' if f <= r / factor else 'misses'} the target, but "
                f"fastckpt ±{_s(nf)} and the reference ±{_s(nr)} overlap it; " + note).rstrip("; ")
    return {**t, "measured": measured, "met": met, "note": note}


def _floor_target(fast: dict[str, Any] | None, core: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 27: the plain-loop stall against the physical floor on CPU, one memcpy of the state, timed in
    fastckpt's own process after its loop (the other peers' processes give the spread)."""
    t = {"name": "(b) plain-loop stall vs one memcpy of the state", "target": "fastckpt <= 2x one memcpy"}
    own = ((fast or {}).get("floor") or {}).get("memcpy_s")
    if not fast or not fast.get("ok") or fast.get("stall_s") is None or not own:
        return {**t, "measured": "n/a (no memcpy floor in this run)", "met": None}
    f, nf = fast["stall_s"], fast.get("noise_s") or 0.0
    samples = [r["floor"]["memcpy_s"] for r in core if r.get("ok") and (r.get("floor") or {}).get("memcpy_s")]
    met: bool | None = True if f + nf <= 2 * own else False if f - nf > 2 * own else None
    note = (f"memcpy in every peer's process: {_ms(min(samples))} to {_ms(max(samples))}; one CRC32C pass in "
            f"fastckpt's: {_ms(fast['floor']['crc_s'])}")
    if met is None:
        note = f"inconclusive: fastckpt ±{_s(nf)} overlaps the target; " + note
    return {**t, "measured": f"{_s(f)} vs {_ms(own)} = {f / own:.2f}x", "met": met, "note": note}


def targets(s: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    core = s.get("core")
    if core is not None:
        fast = _row(core, "fastckpt")
        t = {"name": "(a) save() blocks", "target": "<= 10 ms (median, steady state)"}
        if fast and fast["ok"]:
            ok = fast["block_s"] <= 0.010
            note = f"max {_ms(fast['block_max_s'])}, first (cold) save {_ms(fast['first_block_s'])}"
            rss = s.get("rss")
            if rss and "save_block_median_s" in rss:
                note += f"; over the {rss['n_saves']} saves of (e): median {_ms(rss['save_block_median_s'])}, " \
                        f"max {_ms(max(rss['save_block_s']))}"
            out.append({**t, "measured": _ms(fast["block_s"]), "met": ok, "note": note})
        else:
            out.append({**t, "measured": (fast or {}).get("error", "n/a"), "met": None})
        others = [r for r in core if r["key"] != "fastckpt" and r["ok"] and r.get("stall_s") is not None]
        best = min(others, key=lambda r: r["stall_s"]) if others else None
        out.append(_stall_target(fast, best, 4, f"best peer ({best['label']})" if best else "best peer",
                                 "(b) per-checkpoint stall, plain loop"))
        out.append(_floor_target(fast, core))
    io = s.get("io")
    if io is not None:
        t = {"name": "(c) durable-commit bandwidth", "target": ">= 0.9x raw fsync'd write"}
        if "error" in io:
            out.append({**t, "measured": io["error"], "met": None})
        else:
            out.append({**t, "measured": f"{io['bw_ratio']:.2f}x ({io['fastckpt_MBps']:.0f} vs {io['raw_MBps']:.0f} MB/s)",
                        "met": io["bw_ratio"] >= 0.9,
                        "note": "median of per-pair ratios: " + ", ".join(f"{x:.2f}" for x in io["bw_ratio_pairs"])
                        + (f"; vs a raw O_DIRECT write: {io['bw_ratio_vs_direct']:.2f}x"
                           if io.get("bw_ratio_vs_direct") else "")})
        t = {"name": "(d) load time (warm page cache)", "target": "<= 1/2 of torch.load"}
        if "error" in io:
            out.append({**t, "measured": io["error"], "met": None})
        else:
            r = io["load_warm_ratio"]
            cold = s.get("cold_best")
            note = "" if cold is None else (
                f"cold, from the restore section (a fresh process per load, pages dropped, best of {cold['runs']}): "
                f"{_s(cold['fastckpt_load'])} vs {_s(cold['torch_load'])} = "
                f"{cold['fastckpt_load'] / cold['torch_load']:.2f}x")
            out.append({**t, "measured": f"{_s(min_med(io['load_warm_fastckpt_s']))} vs "
                                         f"{_s(min_med(io['load_warm_torch_s']))} = {r:.2f}x", "met": r <= 0.5,
                        "note": note})
    rss = s.get("rss")
    if rss is not None:
        t = {"name": f"(e) peak RSS over {rss.get('n_saves', '?')} saves",
             "target": "<= 1.1 x (peak RSS without checkpoints + state bytes)"}
        if "error" in rss:
            out.append({**t, "measured": rss["error"], "met": None})
        else:
            lim = rss["target_bytes"]
            out.append({**t, "measured": f"{_gb(rss['peak_rss'])} vs limit {_gb(lim)} "
                                         f"({rss['peak_rss'] / (rss['rss_before_saves'] + rss['state_bytes']):.2f}x)",
                        "met": rss["peak_rss"] <= lim,
                        "note": f"overhead {rss['overhead_in_states']:.2f} x state bytes; host staging "
                                f"{_gb(rss['counters']['host_bytes'])} in {rss['counters']['host_allocations']} buffers"})
    if s.get("busy") is not None:
        out += _busy_targets(s["busy"])
    if s.get("lightning") is not None:
        rows = s["lightning"]
        out.append(_stall_target(_row(rows, "fastckpt"), _row(rows, "async_io"), 5, "AsyncCheckpointIO",
                                 "Lightning Trainer.fit per-checkpoint stall"))
    if s.get("lightning_load") is not None:
        out.append(_load_target(s["lightning_load"]))
    if s.get("accelerate") is not None:
        rows = s["accelerate"]
        out.append(_stall_target(_row(rows, "fastckpt"), _row(rows, "stock"), 10, "stock save_state",
                                 "Accelerate per-checkpoint stall"))
    return out


def _load_target(load: dict[str, Any]) -> dict[str, Any]:
    t = {"name": "Lightning load_from_checkpoint of a fastckpt .ckpt (warm page cache)",
         "target": "no slower than the same state written by torch.save"}
    if "error" in load:
        return {**t, "measured": load["error"], "met": None}
    module, plain = load["load_from_checkpoint"], load["torch_load"]
    warm = module["warm_s"]
    note = f"torch.load: {plain['warm_ratio']:.2f}x"
    if "cold_ratio" in module:
        note += f"; cold (fadvise DONTNEED): {_s(module['cold_s']['fastckpt'])} vs " \
                f"{_s(module['cold_s']['torch_save'])} = {module['cold_ratio']:.2f}x"
    # "No slower" within the run-to-run spread of the reference: a point estimate 2 % above decides nothing.
    spread = (max(warm["torch_save"]) - min(warm["torch_save"])) / min_med(warm["torch_save"])
    return {**t, "measured": f"{_s(min_med(warm['fastckpt']))} vs {_s(min_med(warm['torch_save']))} = "
                             f"{module['warm_ratio']:.2f}x", "met": module["warm_ratio"] <= 1.0 + spread,
            "note": note + f"; spread of the torch.save loads: {spread:.0%}"}


def min_med(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------------------------------- formatting


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    if abs(x) < 1:
        return f"{x * 1e3:.0f} ms"
    return f"{x:.2f} s"


def _gb(x: float | None) -> str:
    return "-" if x is None else f"{x / GB:.2f} GB"


def _pm(row: dict[str, Any]) -> str:
    if row.get("stall_s") is None:
        return "-"
    pooled = row.get("pooled") or {}
    parts = [f"{pooled['windows']} windows, {pooled['runs']} runs pooled"] if pooled.get("windows") else []
    if pooled.get("between_runs_noise_s") is not None:
        runs = ", ".join(_s(x) for x in pooled["run_stalls_s"])
        parts.append(f"the runs: {runs}, ± {_s(pooled['between_runs_noise_s'])} between them")
    more = f" ({'; '.join(parts)})" if parts else ""
    return f"{_s(row['stall_s'])} ± {_s(row['noise_s'])}{more}"


def _vs(fast: float | None, other: float | None) -> str:
    if fast is None or other is None:
        return "-"
    if fast <= 0:
        return "n/a (fastckpt's stall <= 0)"
    return f"{other / fast:.1f}x"


def _met(m: bool | None) -> str:
    return {True: "**met**", False: "**NOT met**", None: "n/a / inconclusive"}[m]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _rss_cell(row: dict[str, Any]) -> str:
    if row.get("peak_rss") is None:
        return "-"
    if row.get("rss_before") is None:
        return _gb(row["peak_rss"])
    return f"{_gb(row['peak_rss'])} (+{_gb(row['peak_rss'] - row['rss_before'])})"


def _restore_cell(row: dict[str, Any]) -> str:
    rt = row.get("restore")
    if not rt or not rt.get("checked"):
        return "-"
    if rt.get("error"):
        return f"**FAILED**: {rt['error'][:200]}"
    if not rt.get("bit_exact"):
        return f"**MISMATCH** at {rt.get('diff')}"
    return f"bit-exact (load {_s(rt.get('load_s'))})"


def _fw_intro(rows: list[dict[str, Any]], plan: dict[str, Any], call: str, baseline: str, end: str,
              flush: str) -> str:
    """How a framework section was measured: paired windows in each run (frameworks.py), or, for a results.json
    from before them, whole runs against a separate baseline."""
    k = plan.get("fw_every", plan.get("every"))
    n = plan.get("fw_n_ckpt", plan.get("n_ckpt"))
    if not any(r.get("window_steps") for r in rows):
        return (f"{call} every {k} steps, {n} checkpoints per run; stall = (timed loop - steps x mean baseline "
                f"step) / checkpoints, the baseline being {baseline} run before and after the others (this run "
                "predates the paired windows: its noise leaves out the drift between processes).")
    return (f"{call} in windows of K={k} steps in one run: clean, checkpointed, clean, ..., {n} checkpointed "
            "windows between clean ones; a checkpointed window holds the checkpoint call after its first step, its "
            "K steps and the config's flush at its end (what the next checkpoint would otherwise wait for). Stall "
            "per checkpoint = median of (checkpointed window - mean of its two clean neighbours), ± its standard "
            f"error, as in the plain loop. One untimed warm-up checkpoint (finished) precedes the windows for every "
            f"config; {baseline} (its own run) is the RSS reference and its step time is shown; the run ends at "
            f"{end}, and {flush} (final flush) is timed after it.")


def _fw_table(rows: list[dict[str, Any]]) -> str:
    fast = _row(rows, "fastckpt")
    fstall = fast.get("stall_s") if fast and fast.get("ok") else None
    body = []
    for r in rows:
        if not r["ok"]:
            body.append([r["label"], r["error"], "", "", "", "", ""])
            continue
        if r["key"] == "baseline":
            body.append([r["label"], f"{_s(r['loop_s'])} ({r['n_steps']} steps, {_s(r['base_step_s'])}/step)", "-",
                         "-", "-", _s(r["flush_s"]), _rss_cell(r)])
            continue
        body.append([r["label"], f"{_s(r['loop_s'])} ({r['n_ckpt']} ckpts)", _ms(r["block_s"]), _pm(r),
                     "1.0x" if r["key"] == "fastckpt" else _vs(fstall, r.get("stall_s")), _s(r["flush_s"]),
                     _rss_cell(r)])
    return _table(["config", "timed loop", "checkpoint call (median)", "per-ckpt stall ± noise",
                   "stall / fastckpt's", "final flush (untimed)", "peak RSS (+ over before saves)"], body)


def console_table(s: dict[str, Any]) -> str:
    lines = ["", "Targets:"]
    for t in s["targets"]:
        mark = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        lines.append(f"  [{mark:>7}] {t['name']}: {t['measured']} (target {t['target']})"
                     + (f" - {t['note']}" if t.get("note") else ""))
    return "\n".join(lines)


def markdown(results: dict[str, Any], s: dict[str, Any], chart_rel: str) -> str:
    meta = s["meta"]
    plan = s["plan"]
    shape = plan.get("shape", {})
    quick = meta.get("quick")
    v = meta.get("versions", {})
    disk = meta.get("disk", {})
    md: list[str] = ["# fastckpt benchmarks", ""]
    if quick:
        md += ["> **QUICK smoke run** (tiny model, in-process): these numbers only show that the harness works.", ""]
    md += [
        f"fastckpt vs its peers, all measured in **one run on one machine** ({meta.get('started', '?')}, "
        f"{meta.get('wall_s', 0) / 60:.1f} min wall).",
        "",
        "> **Noise warning.** This run was taken on a shared 2-core VM (load average "
        f"{meta.get('loadavg_start', [0])[0]:.1f} at the start, {meta.get('loadavg_end', [0])[0]:.1f} at the end) and "
        "its virtual disk's write bandwidth swings several-fold from one write to the next. Stalls are differences "
        "of loop times, so every stall is given with its noise (± one standard error, see Methodology). Re-run on "
        "a quiet machine before quoting numbers.",
        "",
        "## Reproduce",
        "",
        "```bash",
        "pip install torch==2.13.0 && pip install -e '.[bench]'   # CPU torch first; then lightning, accelerate, matplotlib, psutil",
        "pip install -e '.[bench-peers]'                # optional peers: torchsnapshot-nightly, dlrover",
        "pip install --no-deps bytecheckpoint==0.0.2    # optional peer; --no-deps: it pins torch<=2.5, grpcio, protobuf",
        f"{meta.get('command', 'python -m benchmarks.run')}",
        "```",
        "",
        "`python -m benchmarks.run --quick` is the smoke test (tiny model, ~20 s; run by "
        "`tests/test_benchmarks_smoke.py`). A peer whose package is missing is skipped and named below the plain-loop "
        "table. `--only io,core,rss,lightning,accelerate,busy` and `--peers ...` select "
        "parts; `--workdir DIR` puts the checkpoints on another disk (default `bench_out/`, refused on tmpfs); "
        "`--from-json benchmarks/results.json` re-renders this report without measuring, and `--only busy "
        "--merge-into benchmarks/results.json` (or `restore`, `cli`) replaces that section with one measured by its "
        "own run, labelled as such. Stall verdicts are "
        "three-way: met only if fastckpt's stall plus its noise beats the target against the reference minus "
        "its noise, NOT met only if it misses even the other way round, inconclusive otherwise; an inconclusive "
        "stall verdict gets more windows of fastckpt and its reference (`--verdict-rounds N`, default 1, 0 for "
        "none; benchmarks/verdicts.py). "
        f"Raw numbers: `{os.path.relpath(Path(chart_rel).with_suffix('.json'))}`, per-task logs: `bench_out/logs/`.",
        "",
        "## Machine",
        "",
        _table(["", ""], [
            ["CPU", f"{meta.get('cpu', '?')}, {meta.get('logical_cpus', '?')} logical / {meta.get('physical_cpus', '?')} physical cores"],
            ["RAM", f"{meta.get('ram_gb', 0):.1f} GiB"],
            ["Disk under test", f"`{disk.get('path', '?')}`: {disk.get('fstype', '?')} on {disk.get('device', '?')} "
                                f"({disk.get('free_gb', 0):.0f} GiB free)"],
            ["Kernel", meta.get("kernel", "?")],
            ["Software", ", ".join(f"{k} {val}" for k, val in v.items())],
            ["fastckpt", f"git {meta.get('git', {}).get('commit', '?')}"
                         f"{' + uncommitted changes' if meta.get('git', {}).get('dirty') else ''}"],
            ["Training threads", f"`torch.set_num_threads({meta.get('train_threads', '?')})` in every worker: the "
                                 "second core stands in for the host CPU a GPU job leaves to background work "
                                 "(copies, checksums, I/O threads); every peer runs under the same setting"],
            ["Allocator", "in the stall-measuring workers (plain loop, Lightning, Accelerate; every peer alike) "
                          "glibc malloc keeps freed memory (`mallopt(M_MMAP_MAX, 0)`, `M_TRIM_THRESHOLD` 2 GiB), "
                          "the job jemalloc/tcmalloc do in the PyTorch CPU tuning guide: with the defaults every "
                          "backward mmaps, faults, zeroes and unmaps ~300 MB of gradient temporaries, half of a "
                          "step is kernel time and step times swing by +-40%. (c), (d), (e) run with the defaults"],
        ]),
        "",
        "## Workload",
        "",
        f"GPT-2-small-shaped: `nn.Embedding({shape.get('vocab')}, {shape.get('d_model')})` + {shape.get('layers')} x "
        f"`nn.TransformerEncoderLayer({shape.get('d_model')}, {shape.get('heads')}, {shape.get('ffn')}, batch_first=True)` "
        "+ LayerNorm + an LM head tied to the embedding (`F.linear(h, embed.weight)`, so the embedding is stored "
        "once), trained with AdamW (`fused=True`, the CPU fused kernel; same state as plain AdamW) on synthetic "
        f"tokens, batch {shape.get('batch')} x seq {shape.get('seq')}. Saved state: "
        "`{\"model\": model.state_dict(), \"optim\": opt.state_dict(), \"step\": n}`"
        + (f" = **{_gb(_state_bytes(s))}** of tensors." if _state_bytes(s) else "."),
        "",
        f"![results]({chart_rel})",
        "",
        "## Targets",
        "",
        _table(["measure", "target", "measured", "result", "notes"],
               [[t["name"], t["target"], t["measured"], _met(t["met"]), t.get("note", "")] for t in s["targets"]]),
        "",
    ]
    if s.get("core") is not None:
        rows = s["core"]
        fast = _row(rows, "fastckpt")
        fstall = fast["stall_s"] if fast and fast["ok"] else None
        body = []
        for r in rows:
            if not r["ok"]:
                body.append([r["label"], r["error"], "", "", "", "", ""])
                continue
            body.append([r["label"], _ms(r["block_s"]), _pm(r),
                         "1.0x" if r["key"] == "fastckpt" else _vs(fstall, r["stall_s"]), _s(r["flush_s"]),
                         _rss_cell(r), _restore_cell(r)])
        not_measured = [f"{r['label']} ({r['skipped']})" for r in rows if r.get("skipped")]
        not_measured += [f"{name} ({why})" for name, why in peers.NOT_MEASURED.items()]
        md += [
            "## Plain training loop (issue #2: a, b, peak RSS)",
            "",
            f"A checkpoint every K={plan.get('every')} steps: {plan.get('n_ckpt')} checkpointed K-step windows "
            f"interleaved with {plan.get('n_ckpt', 0) + 1} clean ones in one process; clean step time "
            f"{_s(_mean_base(rows))} (mean over all peers). Stall = median over checkpoints of (checkpointed "
            "window - mean of the two neighbouring clean windows); the window includes save(), the K steps and "
            "the peer's flush at its end." + (
                f" K and the number of windows come from a calibration run of the plain loop on this machine "
                f"(step {_s(plan['step_s'])}): K is the fewest steps lasting {plan.get('window_s'):g} s (at most "
                f"12), and the windows fill about {plan.get('core_budget_s'):g} s per peer, since a window's noise "
                "grows with the square root of K and the estimate's shrinks with the square root of the number of "
                "windows." if plan.get("step_s") and plan.get("window_s") else ""),
            "",
            _table(["peer", "save() blocks (median)", "per-ckpt stall ± noise", "stall / fastckpt's",
                    "flush at window end (median)", "peak RSS (+ over the same loop's peak without checkpoints)",
                    "restore (own loader, after the loop)"], body),
            "",
            "Restore: after the timed loop each peer saves the live state once more, waits for it, loads it back "
            "with its own loader (into zeroed tensors where the loader works in place) and compares every tensor "
            "byte for byte and every other value with the state it saved (untimed, not part of the figures above).",
            "",
        ]
        if not_measured:
            md += ["**Peers not measured in this run**: " + "; ".join(not_measured) + ".", ""]
        figs = (fast or {}).get("figures") or {}
        if figs.get("waited_ms"):
            md += [
                f"fastckpt's own figures over these saves (`SaveStats`): the optimizer pre-hook waited "
                f"{statistics.median(figs['waited_ms']):.1f} ms median (max {max(figs['waited_ms']):.1f} ms) for "
                f"the lazy copy; staging finished {statistics.median(figs['staging_ms']):.0f} ms and the commit "
                f"{statistics.median(figs['persist_s']):.2f} s after `save()` (medians). The rest of its stall is "
                "the training step slowed by the background copy, checksums and writes sharing the machine.",
                "",
            ]
    if s.get("busy") is not None:
        md += busy_markdown(results["busy"], s["busy"], s["plan"])
    io = s.get("io")
    if io is not None and "error" not in io:
        md += [
            "## (c) Time to durable commit vs a raw fsync'd write",
            "",
            f"Same {_gb(io['ckpt_bytes'])} (the checkpoint's on-disk size) written {len(io['raw_s'])}x each, "
            "rotating which goes first: raw = one `os.write` stream (64 MiB pieces) from a resident numpy buffer "
            "+ `fsync` (the target's yardstick); raw O_DIRECT = the same from a page-aligned buffer opened with "
            "`O_DIRECT` (informational: on this VM buffered writes + fsync are much slower than direct ones); "
            "fastckpt = `save()` -> `handle.wait()` (copy to host, CRC32C, O_DIRECT writes, fsync, manifest commit).",
            "",
            _table(["", "times", "median", "bandwidth"], [
                ["raw os.write + fsync", ", ".join(_s(x) for x in io["raw_s"]), _s(statistics.median(io["raw_s"])),
                 f"{io['raw_MBps']:.0f} MB/s"],
                ["fastckpt save -> wait", ", ".join(_s(x) for x in io["fastckpt_durable_s"]),
                 _s(statistics.median(io["fastckpt_durable_s"])), f"{io['fastckpt_MBps']:.0f} MB/s"],
                ["ratio fastckpt / raw (per pair)", ", ".join(f"{x:.2f}" for x in io["bw_ratio_pairs"]),
                 f"{io['bw_ratio']:.2f}x", ""],
            ] + ([
                ["raw O_DIRECT os.write + fsync (stricter yardstick)", ", ".join(_s(x) for x in io["raw_direct_s"]),
                 _s(statistics.median(io["raw_direct_s"])), f"{io['raw_direct_MBps']:.0f} MB/s"],
                ["ratio fastckpt / raw O_DIRECT", "", f"{io['bw_ratio_vs_direct']:.2f}x", ""],
            ] if io.get("raw_direct_s") else [])),
            "",
            f"For reference: first (cold: plan + host-buffer allocation) fastckpt save -> wait "
            f"{_s(io['cold_durable_s'])}; `torch.save` of the same state (page cache, no fsync) {_s(io['torch_save_s'])}, "
            f"{_gb(io['torch_save_bytes'])}.",
            "",
            "## (d) Load time",
            "",
            "`torch.load(path, map_location='cpu', weights_only=True)` of the torch.save file vs "
            "`Checkpointer.load(step)` (CRC32C verification on, the default). **Warm**: both checkpoints read once "
            "beforehand so both come from the page cache; interleaved, median. Cold loads: the restore section "
            "(a fresh process per load, several rounds).",
            "",
            _table(["", "torch.load", "fastckpt", "fastckpt / torch.load"], [
                ["warm", ", ".join(_s(x) for x in io["load_warm_torch_s"]),
                 ", ".join(_s(x) for x in io["load_warm_fastckpt_s"]), f"{io['load_warm_ratio']:.2f}x"],
            ]),
            "",
        ]
    elif io is not None:
        md += ["## (c) Durable commit, (d) load", "", io["error"], ""]
    rss = s.get("rss")
    if rss is not None and "error" not in rss:
        md += [
            f"## (e) Peak RSS over {rss['n_saves']} fastckpt saves",
            "",
            f"Training loop, a save every {rss['every']} steps (lazy mode, nothing awaited in the loop, "
            "`retention.keep_last=2` to bound disk use), RSS sampled with psutil every 20 ms in the worker "
            "(cross-checked with the kernel's VmHWM after resetting it via /proc/self/clear_refs). The reference "
            "is the peak RSS of the same process over a few training steps before the first save (quiet RSS "
            f"between steps: {_gb(rss.get('rss_quiet'))}; a step's autograd temporaries add to it).",
            "",
            _table(["peak RSS without checkpoints", "state bytes", "limit 1.1 x (before + state)", "peak RSS (psutil)",
                    "peak (VmHWM)", "overhead", "save() median / max"], [[
                _gb(rss["rss_before_saves"]), _gb(rss["state_bytes"]), _gb(rss["target_bytes"]), _gb(rss["peak_rss"]),
                _gb(rss["peak_rss_hwm"]), f"{rss['overhead_in_states']:.2f} x state",
                f"{_ms(rss['save_block_median_s'])} / {_ms(max(rss['save_block_s']))}"]]),
            "",
            f"fastckpt counters at the end: {rss['counters']}. Persist time per save (save() -> committed): "
            + ", ".join(f"{x:.1f}" for x in rss["persist_s"]) + " s.",
            "",
        ]
    elif rss is not None:
        md += ["## (e) Peak RSS", "", rss["error"], ""]
    if s.get("lightning") is not None:
        md += [
            "## Lightning `Trainer.fit` (issue #3)",
            "",
            *own_run_label(results["lightning"].get("meta")),
            _fw_intro(s["lightning"], results["lightning"].get("plan", plan), "`ModelCheckpoint(save_top_k=-1)` (its trigger gated to the checkpointed "
                      "windows' first step)", "a fit without checkpointing", "`on_train_end`",
                      "the checkpoint IO's `teardown`")
            + " 'checkpoint call' = `ModelCheckpoint._save_checkpoint` (dump_checkpoint + "
            "checkpoint_io.save_checkpoint); the flush that ends a checkpointed window: AsyncCheckpointIO's "
            "worker, `FastCheckpointIO.flush()`.",
            "",
            _fw_table(s["lightning"]),
            "",
        ]
    if s.get("accelerate") is not None:
        md += [
            "## Accelerate loop (issue #4)",
            "",
            *own_run_label(results["accelerate"].get("meta")),
            "`Accelerator(cpu=True, project_config=ProjectConfiguration(automatic_checkpoint_naming=True))`; "
            + _fw_intro(s["accelerate"], results["accelerate"].get("plan", plan), "`accelerator.save_state()`", "a loop without checkpointing",
                        "the last step", "`accelerator.end_training()`")
            + " fastckpt via `fastckpt_accelerate.enable(accelerator, CheckpointConfig(root=...))`; the flush "
            "that ends a checkpointed window: its `wait()` (stock `save_state()` has nothing pending).",
            "",
            _fw_table(s["accelerate"]),
            "",
        ]
    if results.get("restore") is not None:
        from .restore_run import restore_markdown

        md += restore_markdown(results["restore"])
    md += cli_markdown(results.get("cli"))
    if results.get("dedup") is not None:
        from .dedup import dedup_markdown

        md += dedup_markdown(results["dedup"])
    md += [
        "## Methodology",
        "",
        "- **Isolation**: every peer and every config runs in a fresh `python -m benchmarks.worker` subprocess "
        "(model built from the same seed), one after another; `os.sync()` before each so no peer inherits another's "
        "dirty pages. Checkpoints go to the disk under test and are deleted at the end of each task.",
        "- **Plain loop (a, b)**: warm-up steps, a few steps without checkpoints (the no-checkpoint RSS peak), "
        "one untimed warm-up checkpoint (awaited), settle steps, then K-step windows in one process: clean, "
        "checkpointed, clean, ..., checkpointed, clean. A checkpointed window is one steady-state period of "
        "\"a checkpoint every K steps\": building the `state_dict()`s, `save()`, K training steps (with the "
        "peer's waits before `optimizer.step()` and any slowdown of the steps by its background threads) and the "
        "peer's flush at the end (what the next save would otherwise wait for), all timed. Stall per checkpoint "
        "= checkpointed window - mean of its two neighbouring clean windows; the figure is the median over "
        "checkpoints (the mean is in results.json as `stall_mean_s`). Pairing with neighbours cancels the slow "
        "drift of the step time within a process (tens of percent over a minute on this VM), which a baseline "
        "taken before and after the loop does not.",
        "- **What each peer waits for**: torch.save is synchronous (and does not fsync). Lightning "
        "`AsyncCheckpointIO` clones every tensor inside `save_checkpoint` and writes on a thread: nothing to wait "
        "for. DCP `async_save` (default) stages synchronously in the call; the previous upload is awaited before "
        "the next save. DCP + reused `DefaultStager(StagingOptions(use_pinned_memory=False, "
        "use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False))`: the staging future is "
        "awaited right before `optimizer.step()`, the previous upload before the next save. DCP runs without a "
        "process group (`no_dist=True`): torch 2.13's `async_save` does not need `init_process_group`. "
        "torchsnapshot `Snapshot.async_take(path, {'state': StateDict(state)})` returns once every tensor is staged "
        "(CPU tensors cloned), so nothing is awaited before the step; the previous `PendingSnapshot.wait()` before "
        "the next save; it runs in a gloo process group of one (without one it bootstraps a TCPStore, which fails "
        "on this IPv4-only VM); no fsync. DLRover Flash Checkpoint `DdpCheckpointer.save_checkpoint(step + 1, "
        "state, path, StorageType.DISK)` copies the state into shared memory inside the call; a saver process (the "
        "elastic agent's job under `dlrover-run`; here a spawned process running the agent's "
        "`AsyncCheckpointSaver.start_async_saving_ckpt()`, with `ROLE_NAME=dlrover-trainer` as the agent sets for "
        "its workers) `torch.save`s it from there, no fsync of the data file; the previous checkpoint is awaited "
        "before the next save (its saver would otherwise skip the new one while it holds the shared memory), "
        "completion being the step written to `dlrover_latest.txt`, polled every 5 ms (DLRover's own "
        "`wait_latest_checkpoint` polls every 3 s); step + 1 because its saver ignores step 0. ByteCheckpoint "
        "`bytecheckpoint.save(..., framework='ddp', fast_saving=True, callback=...)` clones the tensors inside the "
        "call and writes with fsync on its I/O thread; the callback (tracker file written) is awaited before the "
        "next save; gloo process group of one; its first save per process (the untimed warm-up) is synchronous "
        "and starts its gRPC coordinator process. "
        "fastckpt: `ckpt.watch(optimizer)` (lazy mode, default config: 2 slots, 2 I/O workers, O_DIRECT, fsync); "
        "no wait in the loop; its optimizer pre-hook waits for staging.",
        "- **save() blocks**: wall time of the save call alone (state dicts built before it), median over the "
        "timed loop's checkpoints (steady state; the first, cold save is reported separately).",
        "- **Peak RSS**: psutil, sampled every 20 ms in the worker. Plain loop: '+' is over the peak RSS of the "
        "same process's steps before the first save (training without checkpoints: model, grads, optimizer state, autograd "
        "temporaries, runtime), sampled from the first save to the end. Lightning/Accelerate: '+' is over the "
        "peak of the no-checkpoint run.",
        "- **Noise**: plain loop, busy host, Lightning and Accelerate: ± is the standard error of the median of "
        "the paired differences, from their robust spread (1.4826 x MAD). Framework results from before the "
        "paired windows (whole runs against a separate baseline run): one standard error from the spread of the "
        "baseline step times, which leaves out the drift between processes. A stall smaller than its noise is "
        "not distinguishable from zero.",
    ]
    if plan.get("verdict_rounds"):
        md.append(
            "- **More windows where a verdict needs them**: where a stall verdict (plain loop, Lightning, Accelerate) "
            "is inconclusive after every peer's run, fastckpt and the configuration it is compared with each run "
            f"again in a fresh process with {plan.get('verdict_n_ckpt', '?')} checkpointed windows (the busy host: "
            f"fastckpt beside the neighbours and on the quiet host, {plan.get('busy_n_ckpt', '?')} each), at most "
            f"{plan['verdict_rounds']} time(s), and their paired differences are pooled with the first run's "
            "(benchmarks/verdicts.py); a verdict already decided either way is not measured again. A pooled stall "
            "says how many windows and runs it holds; its other figures (save() blocks, RSS, restore) are the first "
            "run's. Over 3 runs or more a pooled stall's noise is the larger of its windows' standard error and its "
            "runs' (the spread of their stalls over the root of their count).")
    md.append("")
    return "\n".join(md)


def _ratio(x: float | None, ref: float | None) -> str:
    return "-" if x is None or not ref or ref <= 0 else f"{x / ref:.1f}x"


def busy_markdown(busy: dict[str, Any], rows: list[dict[str, Any]], plan: dict[str, Any]) -> list[str]:
    """The busy-host section. ``busy["meta"]``, when present, labels a section measured by its own run."""
    meta = busy.get("meta")
    plan = busy.get("plan") or plan
    ok = [r for r in rows if r["ok"]]
    fast = _row(ok, "fastckpt")
    shape = plan.get("busy_shape") or {}
    md = ["## Busy host: CPU-bound neighbours (DataLoader workers)", ""]
    md += own_run_label(meta)
    md += [
        f"The plain loop (model `{shape.get('layers')} x d{shape.get('d_model')}`, vocab {shape.get('vocab')}: "
        f"{ok[0]['state_bytes'] / 1e6 if ok else 0:.1f} MB of state) with **{busy.get('neighbours')} CPU-bound neighbour "
        + ("processes** (pure-Python spin loops, two pinned to each CPU: wherever the training thread runs it shares "
           "its CPU with two of them; free-running, one more than the cores, they left it a CPU of its own for "
           "spells of several windows, and the paired stall swung by 150 ms between runs, benchmarks/busy.py) "
           if busy.get("pinned") else "processes** (pure-Python spin loops, one more than the host has cores) ") +
        "started before each peer and "
        f"stopped after it: a checkpoint every {plan.get('busy_every')} steps, {plan.get('busy_n_ckpt')} "
        "checkpointed windows between clean ones, stall paired as in the plain loop. Then "
        f"{plan.get('busy_durable_reps')} back-to-back `save()` + flush pairs: the time to a durable commit "
        "when the caller waits for it. fastckpt runs its default `persist.priority` (`normal` since 2026-11-26: "
        "lowered I/O threads that hold the GIL when preempted stalled training for seconds here; see docs/API.md). "
        "The last row is fastckpt's same loop with no neighbours: the reference of the busy stall."
        + (f" Both fastckpt rows are measured in {plan['busy_min_runs']} runs at least, decided or not, their windows "
           "pooled: one run's noise, taken over its own windows, hid a spread of 31 to 50 ms between two runs of the "
           "same code minutes apart (benchmarks/verdicts.py)." if plan.get("busy_min_runs", 1) > 1 else ""),
        "",
    ]
    body = []
    for r in rows:
        if not r["ok"]:
            body.append([r["label"], r["error"], "", "", "", "", ""])
            continue
        dur = statistics.median(r["durable_s"]) if r["durable_s"] else None
        fdur = statistics.median(fast["durable_s"]) if fast and fast["durable_s"] else None
        fblock = fast["block_s"] if fast else None
        body.append([r["label"], f"{_ms(r['block_s'])} / {_ms(r['block_max_s'])} ({_ratio(r['block_s'], fblock)})",
                     _pm(r),
                     f"{_s(r['flush_s'])} / {_s(r['flush_max_s'])}", f"{_s(dur)} ({_ratio(dur, fdur)})",
                     f"{_s(statistics.median(r['persist_s']))} / {_s(max(r['persist_s']))}" if r["persist_s"] else "-",
                     _restore_cell(r)])
    md += [_table(["peer", "save() blocks median / max (median / fastckpt's)", "per-ckpt stall ± noise",
                   "flush at window end median / max", "save + flush = durable, median (/ fastckpt's)",
                   "save -> committed in the loop, median / max (fastckpt's SaveStats)", "restore"], body), "",
           "fastckpt's commit in the loop (save -> committed) overlaps the K training steps: its background threads "
           "run at the training thread's priority (`persist.priority: normal`), and at most `persist.cpu_threads` "
           "of them burn CPU at once (1 here: the CPUs minus training's torch threads), so a checkpoint is durable "
           "well before the window's flush.", ""]
    skipped = [f"{r['label']} ({r['skipped']})" for r in rows if r.get("skipped")]
    if skipped:
        md += ["**Peers not measured in this scenario**: " + "; ".join(skipped) + ".", ""]
    return md


def _state_bytes(s: dict[str, Any]) -> int | None:
    for r in s.get("core") or []:
        if r["ok"]:
            return r["state_bytes"]
    if s.get("io") and "state_bytes" in s["io"]:
        return s["io"]["state_bytes"]
    return None


def _mean_base(rows: list[dict[str, Any]]) -> float | None:
    xs = [r["base_step_s"] for r in rows if r["ok"]]
    return statistics.fmean(xs) if xs else None


# ---------------------------------------------------------------------------------------------- chart


def chart(s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(22, 9))
    axes = axes.ravel()
    fast_color, peer_color, ref_color = "#d62728", "#7f7f7f", "#1f77b4"

    def bars(ax: Any, title: str, labels: list[str], values: list[float | None], errs: list[float] | None = None,
             colors: list[str] | None = None, unit: str = "", log: bool = False) -> None:
        ax.set_title(title, fontsize=10)
        xs = list(range(len(labels)))
        vals = [v if v is not None else 0.0 for v in values]
        ax.bar(xs, vals, yerr=errs, color=colors or peer_color, capsize=3)
        for x, v in zip(xs, values):
            ax.annotate("n/a" if v is None else f"{v:.3g}", (x, 0 if v is None else v), ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel(unit)
        if log and all(v is not None and v > 0 for v in values):
            ax.set_yscale("log")
        ax.axhline(0, color="black", linewidth=0.5)

    def colors_for(keys: list[str]) -> list[str]:
        return [fast_color if k == "fastckpt" else peer_color for k in keys]

    core = [r for r in s.get("core") or [] if not r.get("skipped")]  # skipped peers: named in the report
    if core:
        keys = [r["key"] for r in core]
        labels = [r["label"] for r in core]
        bars(axes[0], "(a) save() blocks, median", labels, [r["block_s"] * 1e3 if r["ok"] else None for r in core],
             colors=colors_for(keys), unit="ms (log)", log=True)
        bars(axes[1], "(b) per-checkpoint stall, plain loop", labels,
             [r["stall_s"] if r["ok"] else None for r in core], [r["noise_s"] if r["ok"] else 0 for r in core],
             colors_for(keys), "s")
        bars(axes[2], "peak RSS over the no-checkpoint peak", labels,
             [(r["peak_rss"] - r["rss_before"]) / GB if r["ok"] else None for r in core], colors=colors_for(keys),
             unit="GB")
    else:
        for ax in axes[:3]:
            ax.set_visible(False)
    io = s.get("io") or {}
    if "raw_MBps" in io:
        lab, vals, cols = ["raw os.write+fsync", "fastckpt save->wait"], [io["raw_MBps"], io["fastckpt_MBps"]], \
            [ref_color, fast_color]
        if io.get("raw_direct_MBps"):
            lab.insert(1, "raw O_DIRECT+fsync")
            vals.insert(1, io["raw_direct_MBps"])
            cols.insert(1, ref_color)
        bars(axes[3], "(c) durable write bandwidth (median)", lab, vals, colors=cols, unit="MB/s")
        lab = ["torch.load warm", "fastckpt warm"]
        vals = [statistics.median(io["load_warm_torch_s"]), statistics.median(io["load_warm_fastckpt_s"])]
        cols = [ref_color, fast_color]
        cold = s.get("cold_best")
        if cold is not None:
            lab += ["torch.load cold (best)", "fastckpt cold (best)"]
            vals += [cold["torch_load"], cold["fastckpt_load"]]
            cols += [ref_color, fast_color]
        bars(axes[4], "(d) load time", lab, vals, colors=cols, unit="s")
    else:
        axes[3].set_visible(False)
        axes[4].set_visible(False)
    rss = s.get("rss") or {}
    if "peak_rss" in rss:
        bars(axes[5], f"(e) fastckpt peak RSS, {rss['n_saves']} saves",
             ["no-ckpt peak", "+ state bytes", "limit 1.1x", "peak"],
             [rss["rss_before_saves"] / GB, (rss["rss_before_saves"] + rss["state_bytes"]) / GB,
              rss["target_bytes"] / GB, rss["peak_rss"] / GB], colors=[peer_color, peer_color, ref_color, fast_color],
             unit="GB")
    else:
        axes[5].set_visible(False)
    for ax, key, title in ((axes[6], "lightning", "Lightning fit: per-checkpoint stall"),
                           (axes[7], "accelerate", "Accelerate: per-checkpoint stall")):
        rows = [r for r in (s.get(key) or []) if r["key"] != "baseline"]
        if not rows:
            ax.set_visible(False)
            continue
        bars(ax, title, [r["label"] for r in rows], [r.get("stall_s") if r["ok"] else None for r in rows],
             [r.get("noise_s") or 0 if r["ok"] else 0 for r in rows], colors_for([r["key"] for r in rows]), "s")
    fig.suptitle("fastckpt vs peers" + (" (QUICK smoke run)" if s["meta"].get("quick") else "")
                 + f" - {s['meta'].get('started', '')}", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
