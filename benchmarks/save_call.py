"""How long ``Checkpointer.save()`` itself holds the training thread on W1: ``python -m benchmarks.save_call
[--saves N] [--steps N] [--fresh-state | --same-state] [--quick] [--profile PATH] [--config JSON] [--json PATH]``.

W1 (the GPT-2-small shape + AdamW, 1.48 GB, 588 tensors) saved as a lazy-mode training loop saves it: the optimizer
watched (its step pre-hook waits for staging and seals the save before), staging prewarmed, one warm-up save, then
``--saves`` timed ``save()`` calls with ``--steps`` training steps before each (the parameters and the AdamW state
change in place between saves, as they do in training). The state is ``model.state_dict()`` + ``opt.state_dict()``
made anew before each save (``--same-state``: one state object saved every time, as benchmarks/launchbound.py
does). Each save starts once the one before is durable (a slot free, as when persistence keeps pace). Only the
``save()`` call is timed: the steps, the seal (at the next step) and the writes are not.

Prints the median and p90 of ``save()`` (wall clock, and the training thread's CPU time in it, which the other
processes of a busy host do not inflate) and, with ``--profile``, a cProfile of one more steady-state save (its top
functions by own time, written in full to PATH as pstats). Config: defaults (health on, lazy mode) unless
``--config`` gives a JSON dict of ``CheckpointConfig`` fields.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["measure", "main"]


def _p90(xs: list[float]) -> float:
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def measure(saves: int, steps: int, fresh: bool, quick: bool, config: dict[str, Any],
            profile: Path | None = None) -> dict[str, Any]:
    """Time ``saves`` steady-state ``save()`` calls of W1 in this process (see the module's docstring)."""
    import torch

    from fastckpt import CheckpointConfig, Checkpointer

    from .workload import FULL, QUICK, Batches, build, make_state, setup_threads, train_step, unique_tensors

    setup_threads()
    shape = QUICK if quick else FULL
    model, opt = build(shape)
    batches = Batches(shape)
    train_step(model, opt, batches)  # AdamW's state exists
    state = make_state(model, opt, 0)
    with tempfile.TemporaryDirectory(prefix="save-call-", dir=os.environ.get("SAVE_CALL_DIR")) as root:
        ckpt = Checkpointer(CheckpointConfig(root=root, **{"retention": {"keep_last": 2}, **config}))
        try:
            ckpt.watch(opt)
            ckpt.prewarm(state).result()
            ckpt.save(state, 0)  # the first save plans and warms: untimed
            ckpt.wait()
            times: list[float] = []
            cpu: list[float] = []  # the training thread's CPU time in save(): what a busy host's preemption leaves out
            for i in range(1, saves + 1):
                for _ in range(steps):
                    train_step(model, opt, batches)  # the pre-hook seals the save before
                ckpt.wait()  # durable: a slot is free, as it is when persistence keeps pace (untimed)
                if fresh:
                    state = make_state(model, opt, i)
                c0, t0 = time.thread_time(), time.perf_counter()
                ckpt.save(state, i)
                times.append((time.perf_counter() - t0) * 1e3)
                cpu.append((time.thread_time() - c0) * 1e3)
            top = None
            if profile is not None:
                for _ in range(steps):
                    train_step(model, opt, batches)
                ckpt.wait()
                if fresh:
                    state = make_state(model, opt, saves + 1)
                prof = cProfile.Profile()
                prof.enable()
                ckpt.save(state, saves + 1)
                prof.disable()
                prof.dump_stats(str(profile))
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
                top = out.getvalue()
            ckpt.wait()
        finally:
            ckpt.close()
    return {"save_ms": times, "median_ms": statistics.median(times), "p90_ms": _p90(times),
            "save_cpu_ms": cpu, "cpu_median_ms": statistics.median(cpu), "cpu_p90_ms": _p90(cpu),
            "tensors": len(unique_tensors(state)), "saves": saves, "steps": steps, "fresh_state": fresh,
            "load_avg": os.getloadavg(), "profile_top": top}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--saves", type=int, default=15)
    ap.add_argument("--steps", type=int, default=1, help="training steps before each save")
    ap.add_argument("--same-state", action="store_true", help="save one state object every time")
    ap.add_argument("--quick", action="store_true", help="the tiny model: a smoke run of seconds")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile one more save into this pstats file")
    ap.add_argument("--config", default="{}", help="CheckpointConfig fields as JSON (default: the defaults)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    res = measure(args.saves, args.steps, not args.same_state, args.quick, json.loads(args.config), args.profile)
    xs = res["save_ms"]
    print(f"save() over {len(xs)} steady-state saves of {res['tensors']} tensors: median {res['median_ms']:.2f} ms, "
          f"p90 {res['p90_ms']:.2f} ms, min {min(xs):.2f}, max {max(xs):.2f}; the training thread's CPU time in it: "
          f"median {res['cpu_median_ms']:.2f} ms, p90 {res['cpu_p90_ms']:.2f} ms (load average "
          f"{', '.join(f'{x:.2f}' for x in res['load_avg'])})")
    if res["profile_top"]:
        print(res["profile_top"])
    if args.json is not None:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
