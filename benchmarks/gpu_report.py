"""Merge the GPU command's section into BENCHMARKS.md: ``## GPU`` naming the device, or "GPU run pending".

``python -m benchmarks.gpu_report [--from OUT_DIR/gpu_bench.json] [--into BENCHMARKS.md]`` replaces the report's
``## GPU`` section (up to the next ``## `` heading), or puts one before ``## Methodology``. A CPU fallback (the
command's dry run) is never merged as GPU figures: the section then says the GPU run is pending.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .gpu_bench import markdown

PENDING = (
    "## GPU\n\nGPU run pending: no GPU machine has run `bash benchmarks/gpu.sh` for this version yet "
    "(README.md, \"On a GPU\"). Its dry run on a CPU checks the command, not the figures.\n"
)


def section(result: dict[str, Any] | None) -> str:
    """The ``## GPU`` markdown of a gpu_bench result, or the pending note when there is none from a GPU."""
    if result is None or not result.get("gpu"):
        return PENDING
    return markdown(result)


# Sections other commands write by hand-run measurements (benchmarks.health, benchmarks.preempt_flush), kept like
# the GPU section when benchmarks.run rewrites the report.
CARRIED = ("## Health statistics cost", "## Where the stall goes", "## Background thread placement",
           "## Background thread placement, busy host",
           "## The floor: what each pass over the state costs the training step",  # benchmarks/copyfloor.py
           "## The launch-bound training thread")  # benchmarks/launchbound.py


def merge(report: str, sect: str, heading: str = "## GPU") -> str:
    """``report`` with its ``heading`` section replaced by ``sect`` (or ``sect`` inserted before Methodology)."""
    lines = report.splitlines(keepends=True)
    heads = [i for i, ln in enumerate(lines) if ln.startswith("## ")]
    body = sect if sect.endswith("\n\n") else sect.rstrip("\n") + "\n\n"
    gpu = [i for i in heads if lines[i].strip() == heading]
    if gpu:
        start = gpu[0]
        end = next((i for i in heads if i > start), len(lines))
        return "".join(lines[:start]) + body + "".join(lines[end:])
    meth = [i for i in heads if lines[i].startswith("## Methodology")]
    at = meth[0] if meth else len(lines)
    return "".join(lines[:at]) + body + "".join(lines[at:])


def existing(report: str, heading: str = "## GPU") -> str | None:
    """The ``heading`` section of a report (up to the next ``## `` heading), or None."""
    lines = report.splitlines(keepends=True)
    heads = [i for i, ln in enumerate(lines) if ln.startswith("## ")]
    gpu = [i for i in heads if lines[i].strip() == heading]
    if not gpu:
        return None
    end = next((i for i in heads if i > gpu[0]), len(lines))
    return "".join(lines[gpu[0]:end])


def carried(new_report: str, old_path: Path) -> str:
    """``new_report`` (benchmarks.run's CPU report, which has no GPU figures) with the GPU section of the file it
    replaces, so that a CPU rerun keeps the last GPU run's figures; "pending" when that file has none."""
    text = old_path.read_text() if old_path.exists() else ""
    old = existing(text)
    report = merge(new_report, old if old is not None else PENDING)
    for heading in CARRIED:
        kept = existing(text, heading)
        if kept is not None:
            report = merge(report, kept, heading)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="src", type=Path, default=None, help="gpu_bench.json of a GPU run")
    ap.add_argument("--into", type=Path, default=Path("BENCHMARKS.md"))
    a = ap.parse_args(argv)
    result = json.loads(a.src.read_text()) if a.src is not None else None
    a.into.write_text(merge(a.into.read_text(), section(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
