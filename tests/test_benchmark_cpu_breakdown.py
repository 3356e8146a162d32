"""Issue 53: ``benchmarks.cpu_breakdown`` (one checkpoint's CPU time per thread kind and, under perf, per phase)
runs end to end on the tiny model, and classes perf's samples by the work they hit."""
from __future__ import annotations

import json
import subprocess
import sys

from benchmarks import REPO, repo_env
from benchmarks.cpu_breakdown import _parse, classify

# ``perf script -F tid,ip,sym,dso`` with call chains: a header line per sample, then its frames, leaf first
SCRIPT = """\
101 
\tffffffff81 copy_user_enhanced_fast_string ([kernel.kallsyms])
\tffffffff82 vfs_write ([kernel.kallsyms])
\tffffffff83 ksys_write ([kernel.kallsyms])
\t7f00 __write (/usr/lib/x86_64-linux-gnu/libc.so.6)

102 
\t5a10 _crc32c_hw_adler (/site-packages/crc32c/_crc32c.cpython-311-x86_64-linux-gnu.so)

102 
\t6b20 at::native::AVX2::norm_two_reduce_step (/site-packages/torch/lib/libtorch_cpu.so)

103 
\t7c30 __memmove_avx_unaligned_erms (/usr/lib/x86_64-linux-gnu/libc.so.6)

103 
\tffffffff84 jbd2_log_wait_commit ([kernel.kallsyms])
\tffffffff85 ext4_sync_file ([kernel.kallsyms])
\tffffffff86 __x64_sys_fsync ([kernel.kallsyms])

104 
\t8d40 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so.1.0)
"""


def test_perf_samples_are_classed_by_the_work_they_hit() -> None:
    samples = _parse(SCRIPT)
    assert [tid for tid, _ in samples] == [101, 102, 102, 103, 103, 104]
    assert [classify(frames) for _, frames in samples] == [
        "write syscalls", "crc32c", "health reductions", "copy", "fsync", "python"]


def test_cpu_breakdown_quick_run_reports_cpu_per_gb_and_threads(tmp_path) -> None:
    out = tmp_path / "cpu.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.cpu_breakdown", "--quick", "--n", "1", "--perf", "0",
                          "--health", "on", "--mode", "hurried,unhurried", "--root", str(tmp_path),
                          "--json", str(out)], cwd=REPO, env=repo_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [r["mode"] for r in doc] == ["hurried", "unhurried"]
    for r in doc:
        assert r["cpu_s_per_gb"] > 0 and r["fs"] != "?"
        assert r["threads_s_per_gb"].get("fastckpt-copy", 0) > 0, r["threads_s_per_gb"]
    assert "CPU-s/GB" in run.stdout
