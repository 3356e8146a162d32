"""Smoke test of the benchmark harness: ``python -m benchmarks.run --quick`` end to end (tiny model, one round of
each measure: ~50 s on 2 quiet cores, ~3 min beside a full test run on them).

The subprocess limits are hang guards only, far above what the busiest machine needs: a smoke test checks that
the harness works, never how fast (issue 55: a 170 s budget failed the suite on a loaded host)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HANG_S = 1500  # a hang guard: the run is ~50 s quiet and ~170 s at a load of 8 on 2 cores

pytest.importorskip("matplotlib")
pytest.importorskip("lightning")
pytest.importorskip("accelerate")


@pytest.mark.timeout(HANG_S + 60)
def test_quick_benchmark_run_writes_report(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(out), "--workdir", str(tmp_path / "work")],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    md = out.read_text()
    for heading in ("## Reproduce", "## Machine", "## Targets", "## Plain training loop", "## (c) Time to durable",
                    "## (d) Load time", "## (e) Peak RSS", "## Lightning", "## Accelerate", "## Busy host",
                    "## Methodology"):
        assert heading in md, heading
    assert "python -m benchmarks.run --quick" in md
    assert "![results](BENCHMARKS.png)" in md

    png = tmp_path / "BENCHMARKS.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    res = json.loads((tmp_path / "BENCHMARKS.json").read_text())
    # The harness itself must work for every peer; the integrations under development may report
    # "n/a (error: ...)" instead, which the report must then show.
    for name, r in res["core"].items():
        if r.get("skipped"):  # an optional peer that is not installed here: named in the report instead
            assert "not installed" in r["skipped"], (name, r["skipped"])
            assert f"skipped: {r['skipped']}" in md, name
            continue
        assert r["ok"], (name, r.get("error"))
        restore = r["result"]["restore"]  # each peer's own loader gives back what it saved, bit for bit
        assert restore["checked"] and restore["bit_exact"], (name, restore)
    assert "DataStates-LLM" in md  # the peer this suite cannot install is named with the reason
    assert res["busy"]["neighbours"] >= 2
    for name, r in res["busy"]["peers"].items():  # every installed peer ran beside the CPU-bound neighbours
        if r.get("skipped"):
            assert "not installed" in r["skipped"], (name, r["skipped"])
            continue
        assert r["ok"], (name, r.get("error"))
        assert r["result"]["durable_s"] and r["result"]["restore"]["bit_exact"], (name, r["result"]["restore"])
    assert res["io"]["ok"], res["io"].get("error")
    assert res["rss"]["ok"], res["rss"].get("error")
    for section, integration in (("lightning", "fastckpt"), ("accelerate", "fastckpt")):
        assert res[section]["plan"]["fw_every"] >= 1  # the section carries its plan: it may be merged alone
        for cfg, r in res[section].items():
            if cfg in ("plan", "meta"):
                continue
            runs = r if isinstance(r, list) else [r]
            for run in runs:
                if cfg == integration and not run["ok"]:
                    assert "n/a (error:" in md
                else:
                    assert run["ok"], (section, cfg, run.get("error"))
    for section in ("lightning", "accelerate"):  # the stall is paired in windows inside each run, as the plain loop's
        for cfg, r in res[section].items():
            if cfg in ("baseline", "plan", "meta") or not r["ok"]:
                continue
            got = r["result"]
            assert len(got["windows_s"]) == 2 * got["n_ckpt"] + 1 and len(got["stall_pairs_s"]) == got["n_ckpt"] > 0
            assert got["windows_s"][1::2] and min(got["windows_s"]) > 0, (section, cfg, got["windows_s"])
    floor = res["core"]["fastckpt"]["result"]["floor"]  # issue 27: the stall against one memcpy of the state
    assert floor["memcpy_s"] > 0 and floor["crc_s"] > 0
    assert res["busy"]["quiet"]["ok"] and res["busy"]["quiet"]["result"]["neighbours"] == 0
    for row in ("plain-loop stall vs one memcpy of the state", "Busy host: save at the loop's end -> durable",
                "Busy host: per-checkpoint stall", "fastckpt, no neighbours (reference)"):
        assert row in md, row
    load = res["lightning_load"]  # load_from_checkpoint: a fastckpt .ckpt vs the same state from torch.save
    assert load["ok"], load.get("error")
    assert set(load["result"]["load_from_checkpoint"]["warm_s"]) == {"fastckpt", "torch_save"}
    assert "load_from_checkpoint of a fastckpt .ckpt" in md
    # targets are evaluated (met or not) for every measure
    # (a noisy stall verdict is "n/a / inconclusive": evaluated too)
    assert md.count("**met**") + md.count("**NOT met**") + md.count("| n/a |") + md.count("| n/a / inconclusive |") >= 8
    # checkpoints are cleaned up
    assert not (tmp_path / "work" / "ckpt").exists()


COMMITTED = [REPO / "BENCHMARKS.md", REPO / "benchmarks" / "results.json", REPO / "benchmarks" / "results.png"]


@pytest.mark.timeout(HANG_S + 60)
def test_quick_run_without_out_leaves_the_committed_report_alone(tmp_path: Path) -> None:
    before = {path: path.read_bytes() for path in COMMITTED}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.run", "--quick", "--only", "io", "--workdir", str(tmp_path / "work")],
            cwd=REPO, capture_output=True, text=True, timeout=HANG_S,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        changed = [str(path) for path in COMMITTED if path.read_bytes() != before[path]]
        assert not changed, f"--quick overwrote {changed}"
    finally:  # a failing run must not leave the worktree's committed report replaced
        for path, data in before.items():
            if path.read_bytes() != data:
                path.write_bytes(data)
    scratch = REPO / "benchmarks" / "out-quick"
    assert str(scratch / "BENCHMARKS.md") in proc.stdout  # the run says where its report went
    assert "## Methodology" in (scratch / "BENCHMARKS.md").read_text()
    assert (scratch / "BENCHMARKS.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(scratch / "BENCHMARKS.md")], cwd=REPO)
    assert ignored.returncode == 0, "benchmarks/out-quick/ must be ignored by git"


def test_in_process_tasks_find_the_earlier_heap_frozen_and_leave_nothing_frozen(tmp_path: Path, monkeypatch) -> None:
    """--quick runs every task in one interpreter that holds torch, Lightning and Accelerate: each task's own
    gc.collect() walked all of their objects (0.4 s each, 72 times a run). The runner freezes what survives the
    previous task, so a task's collection walks only what it made; closed, it leaves the interpreter as it was."""
    import gc

    from benchmarks import worker
    from benchmarks.run import Runner

    monkeypatch.setattr(worker, "_tasks", lambda: {"probe": lambda: {"frozen": gc.get_freeze_count()}})
    assert gc.get_freeze_count() == 0
    runner = Runner(tmp_path, isolate=False, timeout=60)
    try:
        first, second = runner("probe", "probe", {}), runner("probe again", "probe", {})
    finally:
        runner.close()
    assert first["ok"] and second["ok"], (first, second)
    assert first["result"]["frozen"] > 10_000 and second["result"]["frozen"] >= first["result"]["frozen"]
    assert gc.get_freeze_count() == 0
