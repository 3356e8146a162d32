"""More windows where a stall verdict needs them (issue 27).

A stall verdict is three-way (``report._stall_target``): met only if fastckpt's stall plus its noise beats the target
against the reference minus its noise. One run of 8 checkpointed windows at the calibrated ~1.5 s steps measures
fastckpt's stall with a noise of ±70-80 ms on the 2-core box, and the plain-loop target (a quarter of the best peer's
~400 ms) is ~100 ms: three full runs in a row came out inconclusive, in different rows each time. The noise shrinks
with the square root of the windows, so when a verdict is inconclusive the two configurations it compares (fastckpt
and its reference) each run once more, in fresh processes, with ``verdict_n_ckpt`` windows, and their paired
differences are pooled with the first run's (every difference pairs a checkpointed window with the clean windows on
either side of it in the same process, so pairs from several processes are alike). At most ``verdict_rounds`` such
rounds per comparison; a comparison already decided either way (met *or* NOT met) is never measured again, so the
extra windows buy precision, not a chosen answer. The report names, per stall, the runs and windows it pools.

The busy-host stall is judged the same way against fastckpt's own loop on the quiet host (``top_up_busy``): its two
runs are the ones measured again, and never fewer than ``BUSY_MIN_RUNS`` times each, decided or not: the same code
gave 31 +- 4 ms (met) and 50 +- 5 ms (NOT met) in two busy runs minutes apart (2026-11-30), a spread between runs
that one run's noise, taken over its own windows, does not show.

Pooled over three runs or more, a stall's noise is the larger of the pooled windows' standard error and that of the
runs' own stalls (their standard deviation over the square root of their count): windows of one run share its
spells of the host (which CPU the scheduler left the training thread, the disk's mood), so pooling them across runs
must not claim more precision than the runs agree to.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from fastckpt.timeline import median_and_noise

from . import report

BUSY_MIN_RUNS = 3  # runs of fastckpt beside the neighbours and on the quiet host before the busy verdict counts

# (section, the target's name in report.targets, the reference config; None: the best peer of the plain loop)
COMPARISONS: dict[str, tuple[str, str | None]] = {
    "core": ("(b) per-checkpoint stall, plain loop", None),
    "lightning": ("Lightning Trainer.fit per-checkpoint stall", "async_io"),
    "accelerate": ("Accelerate per-checkpoint stall", "stock"),
}

BUSY = "Busy host: per-checkpoint stall"  # compares results["busy"]["peers"]["fastckpt"] with results["busy"]["quiet"]

Run = Callable[[str, str, dict[str, Any]], dict[str, Any]]


def verdict(section: str, results: dict[str, Any]) -> bool | None:
    """The section's stall verdict as the report would give it: True met, False NOT met, None inconclusive."""
    name, _ = COMPARISONS[section]
    for t in report.summarize({section: results[section]})["targets"]:
        if t["name"] == name:
            return t["met"]
    raise KeyError(f"no target {name!r} in the {section} section")


def reference(section: str, results: dict[str, Any]) -> str | None:
    """The configuration fastckpt is compared with: the fixed one, or the plain loop's best peer (lowest stall)."""
    _, ref = COMPARISONS[section]
    if ref is not None:
        return ref
    stalls = {name: res["result"]["stall_s"] for name, res in results[section].items()
              if name != "fastckpt" and res.get("ok") and res["result"].get("stall_s") is not None}
    return min(stalls, key=stalls.__getitem__) if stalls else None


def _measured(entry: dict[str, Any] | None) -> bool:
    return bool(entry and entry.get("ok") and entry["result"].get("stall_pairs_s"))


def pool(entry: dict[str, Any], extra: dict[str, Any]) -> None:
    """Fold ``extra`` (a run of the same task) into ``entry``: its paired differences join the first run's and the
    stall and its noise are taken again over all of them. The other figures (save() blocks, RSS, restore) stay the
    first run's; the extra run is kept whole under ``extra_runs``."""
    entry.setdefault("extra_runs", []).append(extra)
    if not extra.get("ok"):
        return  # reported as is: the first run's figures stand
    res = entry["result"]
    pooled = res.setdefault("pooled", {"runs": 1, "first": {k: res[k] for k in ("stall_s", "noise_s")}})
    per_run = pooled.setdefault("run_stalls_s", [pooled["first"]["stall_s"]])
    per_run.append(extra["result"]["stall_s"])  # the run's own median, as the first's (measure.paired_stall)
    pairs = list(res["stall_pairs_s"]) + list(extra["result"]["stall_pairs_s"])
    res["stall_s"], res["noise_s"] = median_and_noise(pairs)
    if len(per_run) >= 3:  # enough runs to see their spread: the windows of one run are not independent draws
        pooled["between_runs_noise_s"] = statistics.stdev(per_run) / len(per_run) ** 0.5
        res["noise_s"] = max(res["noise_s"], pooled["between_runs_noise_s"])
    res["stall_mean_s"] = statistics.fmean(pairs)
    res["stall_pairs_s"] = pairs
    pooled["runs"] += 1
    pooled["windows"] = len(pairs)


def top_up(run: Run, results: dict[str, Any], section: str, args_for: Callable[[str, int], dict[str, Any]],
           rounds: int, n_ckpt: int, log: Callable[[str], None]) -> None:
    """Run fastckpt and its reference again (``n_ckpt`` windows each) while ``section``'s verdict is inconclusive,
    at most ``rounds`` times. ``args_for(config, n_ckpt)``: the arguments of the section's task (the worker task of
    the same name) for one configuration."""
    for i in range(rounds):
        if verdict(section, results) is not None:
            return
        ref = reference(section, results)
        if ref is None or not all(_measured(results[section].get(c)) for c in ("fastckpt", ref)):
            return  # n/a rather than inconclusive (a run failed or was skipped): the report says why
        log(f"{section}: the stall verdict is inconclusive: fastckpt and {ref} run again with {n_ckpt} windows "
            f"each (round {i + 1} of {rounds})")
        for config in ("fastckpt", ref):
            extra = run(f"{section}: {config} (more windows, round {i + 1})", section, args_for(config, n_ckpt))
            pool(results[section][config], extra)


def busy_verdict(busy: dict[str, Any]) -> bool | None:
    """The busy-host stall's verdict as the report would give it (``busy``: the section's results)."""
    for t in report.summarize({"busy": busy})["targets"]:
        if t["name"] == BUSY:
            return t["met"]
    raise KeyError(f"no target {BUSY!r} in the busy section")


def _runs(entry: dict[str, Any]) -> int:
    return int((entry["result"].get("pooled") or {}).get("runs", 1))


def top_up_busy(run: Run, busy: dict[str, Any], args_for: Callable[[bool, int], dict[str, Any]], rounds: int,
                n_ckpt: int, log: Callable[[str], None], min_runs: int = BUSY_MIN_RUNS) -> None:
    """Run fastckpt beside the neighbours and on the quiet host again (``n_ckpt`` windows each) until each holds
    ``min_runs`` runs, decided or not, then while the busy stall's verdict is inconclusive, at most ``rounds`` more
    times. ``args_for(busy, n_ckpt)``: the busy task's arguments, with the neighbours (True) or without them
    (False)."""
    extra = 0
    for _ in range(max(0, min_runs - 1) + rounds):  # bounded: a failed run is kept, not counted (``pool``)
        entries = {True: busy.get("peers", {}).get("fastckpt"), False: busy.get("quiet")}
        if not all(_measured(e) for e in entries.values()):
            return
        if min(_runs(e) for e in entries.values()) < min_runs:  # type: ignore[arg-type]
            why = f"each is measured in {min_runs} runs at least"
        elif busy_verdict(busy) is None and extra < rounds:
            extra += 1
            why = f"the stall verdict is inconclusive (round {extra} of {rounds})"
        else:
            return
        i = max(_runs(e) for e in entries.values())  # type: ignore[arg-type]
        log(f"busy host: {why}: fastckpt with and without the neighbours runs again with {n_ckpt} windows each")
        for with_neighbours, entry in entries.items():
            what = "beside the neighbours" if with_neighbours else "with no neighbours"
            pool(entry, run(f"busy host: fastckpt {what} (run {i + 1})", "busy", args_for(with_neighbours, n_ckpt)))
