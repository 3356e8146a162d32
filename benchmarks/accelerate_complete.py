"""``python -m benchmarks.accelerate_complete [--reps 5] [--saves 15] [--width 768] [--code OLD_CHECKOUT]``: what
``complete_folders`` costs Accelerate's ``save_state()``.

Each run is a fresh process (fastckpt_accelerate on a small MLP + AdamW; ``--width 768``: a ~7 MB folder, fsync on)
that saves ``--saves`` times with automatic naming, each followed at once by ``wait_for_everyone()`` (which seals the
lazy copy: a save commits only once sealed): the ``save_state()`` call time, and the commit latency (from the call's
return to the save's ``durable`` future completing: copy, writes, links, and for ``complete_folders`` the rename
into place and the parent folder's fsync, also timed alone). Configurations alternate run by
run: ``default`` and ``complete`` (``complete_folders=True``) of this checkout, and ``before`` (the default of the
checkout at ``--code``, e.g. ``git archive <commit> | tar -x -C DIR``). Prints medians and p90 over every save but
each run's first. docs/accelerate.md, "When the files are there".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent("""
    import json, os, sys, time
    sys.path[:0] = [sys.argv[1], sys.argv[1] + "/tests"]
    import fastckpt_accelerate
    from accelerate_testing import Setup, make_accelerator
    project, saves, width, complete = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
    acc = make_accelerator(project, total_limit=3)
    extra = {"complete_folders": True} if complete else {}
    renames = []
    if complete:  # the commit's added step timed alone: the guard, the rename and the parent folder's fsync
        from fastckpt.format.bundle import FileBundle
        place = FileBundle._rename_into_place
        def timed(self, *args, **kwargs):
            t = time.perf_counter()
            place(self, *args, **kwargs)
            renames.append((time.perf_counter() - t) * 1e3)
        FileBundle._rename_into_place = timed
    checkpointing = fastckpt_accelerate.enable(acc, **extra)
    setup = Setup(acc, width=width)
    calls, commits = [], []
    for _ in range(saves):
        setup.step()
        t0 = time.perf_counter()
        acc.save_state()
        returned = time.perf_counter()
        stamp = {}
        checkpointing.last_handle.durable.add_done_callback(lambda f: stamp.setdefault("t", time.perf_counter()))
        acc.wait_for_everyone()  # seals the lazy copy at once (a save commits only once sealed), then waits
        calls.append((returned - t0) * 1e3)
        commits.append((stamp["t"] - returned) * 1e3)
    acc.end_training()
    print(json.dumps({"call_ms": calls[1:], "commit_ms": commits[1:], "rename_ms": renames[1:]}))
""")


def _run(code: Path, complete: bool, saves: int, width: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="fastckpt-complete-") as project:
        out = subprocess.run([sys.executable, "-c", _CHILD, str(code), project, str(saves), str(width),
                              "1" if complete else "0"], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--saves", type=int, default=15)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--code", type=Path, default=None, help="an older checkout, run as 'before'")
    args = parser.parse_args(argv)
    configs = [("default", REPO, False), ("complete", REPO, True)]
    if args.code is not None:
        configs.insert(0, ("before", args.code.resolve(), False))
    figures: dict[str, dict[str, list[float]]] = {name: {"call_ms": [], "commit_ms": []} for name, _, _ in configs}
    for _ in range(args.reps):
        for name, code, complete in configs:
            got = _run(code, complete, args.saves, args.width)
            for key in ("call_ms", "commit_ms", "rename_ms"):
                figures[name].setdefault(key, []).extend(got.get(key) or [])
    print(f"load average {os.getloadavg()[0]:.1f}; {args.reps} runs x {args.saves - 1} saves each, width {args.width}")
    for name, got in figures.items():
        print(f"{name:9s} save_state() {statistics.median(got['call_ms']):7.2f} ms median, "
              f"{_p90(got['call_ms']):7.2f} p90 | commit {statistics.median(got['commit_ms']):7.2f} ms median, "
              f"{_p90(got['commit_ms']):7.2f} p90"
              + (f" | of which the rename {statistics.median(got['rename_ms']):5.2f} ms median, "
                 f"{_p90(got['rename_ms']):5.2f} p90" if got.get("rename_ms") else ""))


if __name__ == "__main__":
    main()
