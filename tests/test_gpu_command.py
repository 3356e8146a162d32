"""The GPU command (benchmarks/gpu.sh) cannot rot unseen on a machine without a GPU.

- Its wheel list (benchmarks/gpu_wheels.sh) plus the GPU machine's packages (benchmarks/gpu_machine_packages.txt)
  cover every hard third-party import of the package: the GPU machine has no network.
- Its dry run runs end to end here: CUDA tests collected and skipped, the benchmark a labelled CPU fallback
  with bit-exact restores, the FSDP2 and Accelerate FSDP2 checks passed on gloo, Lightning's FSDP1 skipped with a reason.
- The GPU section of BENCHMARKS.md is never filled from a CPU fallback.
"""
from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from benchmarks import gpu_report

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("fastckpt", "fastckpt_lightning", "fastckpt_accelerate")


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether an import is inside a function or a try (lazy or optional), so not a hard import."""
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Try)):
            return True
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def hard_imports() -> dict[str, str]:
    """Top-level third-party module -> the first file importing it at module level."""
    found: dict[str, str] = {}
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in PACKAGES or top == "__future__":
                        continue
                    if not _guarded(node, parents):
                        found.setdefault(top, str(path.relative_to(REPO)))
    return found


def wheel_list() -> dict[str, str]:
    """distribution -> pinned version, from the WHEELS=( ... ) array of gpu_wheels.sh."""
    text = (REPO / "benchmarks" / "gpu_wheels.sh").read_text()
    block = re.search(r"^WHEELS=\((.*?)^\)", text, re.S | re.M)
    assert block, "benchmarks/gpu_wheels.sh: no WHEELS=( ... ) array"
    pins = [ln.split("#")[0].strip() for ln in block.group(1).splitlines()]
    return {_norm(p.split("==")[0]): p.split("==")[1] for p in pins if p}


def machine_packages() -> set[str]:
    lines = (REPO / "benchmarks" / "gpu_machine_packages.txt").read_text().splitlines()
    return {_norm(ln.strip()) for ln in lines if ln.strip() and not ln.startswith("#")}


def test_every_hard_import_is_on_the_gpu_machine_or_in_the_wheel_list() -> None:
    dists = importlib.metadata.packages_distributions()
    imports = hard_imports()
    assert {"torch", "crc32c"} <= set(imports), imports  # the parse sees the imports we know of
    have, wheels = machine_packages(), wheel_list()
    missing = {}
    for mod, where in imports.items():
        names = {_norm(d) for d in dists.get(mod, [mod])}
        if not names & (have | set(wheels)):
            missing[mod] = f"{where} (distribution {sorted(names)})"
    assert not missing, (
        f"imported at module level but neither on the GPU machine (benchmarks/gpu_machine_packages.txt) nor in "
        f"benchmarks/gpu_wheels.sh WHEELS: {missing}; add a pinned wheel there"
    )


def test_every_declared_dependency_is_on_the_gpu_machine_or_in_the_wheel_list() -> None:
    """pyproject's dependencies too: zlib-ng is imported under a try (a 5x slower fallback), still wanted there."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {_norm(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) for d in deps}
    assert "zlib-ng" in names
    missing = names - machine_packages() - set(wheel_list())
    assert not missing, f"pyproject dependencies neither on the GPU machine nor in gpu_wheels.sh WHEELS: {missing}"


def test_the_wheels_are_pinned_to_the_versions_tested_here() -> None:
    for dist, version in wheel_list().items():
        assert importlib.metadata.version(dist) == version, f"gpu_wheels.sh pins {dist}=={version}; this venv has another"


def test_the_machine_list_is_the_one_read_from_kinds_md() -> None:
    have = machine_packages()
    assert {"torch", "lightning", "accelerate", "safetensors", "pytest-timeout", "xxhash"} <= have
    assert not {"crc32c", "zlib-ng"} & have  # what the issue says is missing there


@pytest.mark.timeout(600)  # a hang guard: ~45 s on 2 quiet cores, 234 s beside two CPU-bound processes and a full run
def test_dry_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # One OpenMP thread a process, as the other tests' subprocesses: with two, each tiny step's threads spun waiting
    # for a CPU that the other test worker held, and the CPU fallback's steps took 10x longer (gpu_bench 40 -> 20 s CPU).
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu.sh"), "--dry-run", "--tests", "tests/test_cuda.py",
         str(tmp_path / "no-wheels"), str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=540, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    files = {p.name for p in out.iterdir()}
    assert files == {"summary.md", "env.txt", "cuda_tests.xml", "cuda_tests.txt", "gpu_bench.json", "gpu_bench.md",
                     "fsdp.json", "logs.txt"}, files  # 8 at most: what the device tool brings back
    summary = (out / "summary.md").read_text()
    assert "DRY RUN, CPU" in summary and "TIMED OUT" not in summary, summary
    # the CPUs this machine gives it, whatever OMP_NUM_THREADS says (nproc obeys it)
    assert f"; cpus {len(os.sched_getaffinity(0))}\n" in (out / "env.txt").read_text(), (out / "env.txt").read_text()
    assert "CUDA tests (pytest -m cuda): rc=" in summary and "GPU benchmark: rc=0" in summary, summary
    # the GIL hand-overs of the CUDA path (--cuda on a GPU; the CPU path here): two runs, each a line in the summary
    assert "GIL hand-overs, CUDA path: rc=0" in summary and summary.count("checkpoint 1: background") == 2, summary
    bench = json.loads((out / "gpu_bench.json").read_text())
    assert bench["gpu"] is False and bench["device"].startswith("CPU fallback"), bench["device"]
    assert [r["peer"].split(" (")[0] for r in bench["peers"]] == ["fastckpt", "dcp_async_save", "lightning AsyncCheckpointIO",
                                                                   "torch_checkpointing CheckpointManager", "fastckpt",
                                                                   "fastckpt", "fastckpt", "fastckpt"]  # + --variants
    assert "later_gbps" in bench["staging_probe"], bench["staging_probe"]
    for r in bench["peers"]:
        assert "error" not in r and r["bit_exact"], r
    assert "CPU fallback, not a GPU measurement" in (out / "gpu_bench.md").read_text()
    fsdp = json.loads((out / "fsdp.json").read_text())
    assert fsdp["core_fsdp2"]["status"] == "passed", fsdp
    assert fsdp["accelerate_fsdp2"]["status"] == "passed" and "by hand" in fsdp["accelerate_fsdp2"]["fsdp_gate"], fsdp
    assert fsdp["lightning_fsdp"]["status"] == "skipped" and "accelerator" in fsdp["lightning_fsdp"]["reason"], fsdp
    # a CPU fallback never becomes the GPU section
    assert gpu_report.section(bench) == gpu_report.PENDING


def test_gpu_section_names_the_device_and_replaces_the_old_one() -> None:
    result = {"device": "NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, CUDA 13.0)", "gpu": True, "params": 163e6,
              "shape": {}, "every": 10, "pinned_peak_gbps": 50.0, "peers": [
                  {"peer": "fastckpt", "step_s": 0.1, "stall_s": 0.002, "stall_fraction_of_step": 0.02,
                   "save_call_s": 0.003, "stalls_ms": [500.0, 2.0, 2.5], "d2h_gbps": 40.0, "bit_exact": True},
                  {"peer": "dcp", "error": "Traceback\nImportError: x"}]}
    report = "# B\n\n## Restore\n\nr\n\n## GPU\n\nGPU run pending\n\n## Methodology\n\nm\n"
    merged = gpu_report.merge(report, gpu_report.section(result))
    assert merged.count("## GPU") == 1 and "pending" not in merged
    assert "NVIDIA H100 80GB HBM3" in merged and "| fastckpt | 100.0 | 2.0 | 0.02 | 500.0 | 3.0 | 40.0 | yes |" in merged
    assert merged.index("## GPU") < merged.index("## Methodology") and "failed: ImportError: x" in merged
    fresh = gpu_report.merge("# B\n\n## Methodology\n\nm\n", gpu_report.PENDING)
    assert fresh.index("GPU run pending") < fresh.index("## Methodology")


def test_a_cpu_rerun_of_the_report_keeps_the_gpu_section(tmp_path: Path) -> None:
    old = tmp_path / "BENCHMARKS.md"
    old.write_text("# B\n\n## GPU\n\nDevice: **NVIDIA H200**.\n\n## Methodology\n\nold\n")
    new = gpu_report.carried("# B\n\n## Restore\n\nnew\n\n## Methodology\n\nnew\n", old)
    assert "Device: **NVIDIA H200**." in new and "## Restore" in new and new.count("## GPU") == 1
    assert new.index("## GPU") < new.index("## Methodology")
    assert "GPU run pending" in gpu_report.carried("# B\n\n## Methodology\n", tmp_path / "absent.md")


def test_a_cpu_rerun_of_the_report_keeps_the_hand_measured_sections(tmp_path: Path) -> None:
    # benchmarks.health's figures are measured by a separate command: a rerun of benchmarks.run must not drop them
    old = tmp_path / "BENCHMARKS.md"
    old.write_text("# B\n\n## Health statistics cost\n\n| 1.24x |\n\n## Methodology\n\nold\n")
    new = gpu_report.carried("# B\n\n## Restore\n\nnew\n\n## Methodology\n\nnew\n", old)
    assert "| 1.24x |" in new and new.count("## Health statistics cost") == 1 and "GPU run pending" in new
    assert new.index("## Health statistics cost") < new.index("## Methodology")
