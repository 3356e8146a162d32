"""Smoke test of the stall breakdown (``python -m benchmarks.run --only breakdown``): tiny model, in-process, one run
of each configuration; the section lands in the report and leaves every other section of that report alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HANG_S = 900  # a hang guard, not a budget: the run takes ~10 s on 2 quiet cores, a few times that on a loaded host


@pytest.mark.timeout(HANG_S + 60)
def test_breakdown_writes_its_section_only(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("## Plain training loop\n\nkept as it is\n\n## Methodology\n\nkept too\n")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--only", "breakdown", "--breakdown-reps", "1",
         "--out", str(out), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_S, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = out.read_text()
    assert "kept as it is" in md and "kept too" in md
    assert md.index("## Where the stall goes") < md.index("## Methodology")
    for row in ("stall per checkpoint", "run-queue delay", "fastckpt-copy CPU", "fastckpt-io CPU", "Floor: one memcpy"):
        assert row in md, row
    res = json.loads((tmp_path / "breakdown.json").read_text())
    for cfg, runs in res["runs"].items():
        assert runs and runs[0]["ok"], (cfg, runs[0].get("error"))
        r = runs[0]["result"]
        assert r["memcpy_s"] > 0 and r["crc_s"] > 0 and r["state_bytes"] > 0
        assert r["bg_cpu_s"].get("fastckpt-copy", 0.0) >= 0.0
