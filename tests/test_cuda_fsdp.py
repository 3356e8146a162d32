"""On a GPU, Lightning FSDP1 sharded saves go through fastckpt and load back bit for bit (world size 1).

- Lightning ``FastFSDPStrategy(state_dict_type="sharded")`` (FSDP1: torch's FullyShardedDataParallel raises 'FSDP
  needs a non-CPU accelerator device' on CPU, so this test cannot run without CUDA): saved through fastckpt, and
  by stock FSDPStrategy (DCP); each loaded by a fresh Trainer equals the state at save. On one GPU torch clamps
  FSDP1 to NO_SHARD (plain tensors in its "sharded" state dict): the route is tested, not DTensor blocks.

It runs ``benchmarks/gpu_fsdp.py``'s check in a child process with its own one-process NCCL group. Accelerate FSDP2
is tested on CPU (tests/test_accelerate_fsdp2.py, 2 gloo processes) and on the GPU by ``gpu_fsdp``'s own step of
benchmarks/gpu.sh; not repeated here, to keep the CUDA tests' share of the device time small.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

_CHILD = textwrap.dedent("""
    import json, os, socket, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from benchmarks import gpu_fsdp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1)
    result = getattr(gpu_fsdp, sys.argv[1])(dev, Path(sys.argv[2]))
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result))
""")


def _check(name: str, work: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _CHILD, name, str(work)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=110)  # under gpu.sh's --timeout 120
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"{name} exited {done.returncode}:\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_lightning_fsdp1_sharded_saves_through_fastckpt_bit_exact_against_stock(tmp_path: Path) -> None:
    result = _check("lightning_fsdp", tmp_path)
    assert result["status"] == "passed", result
    assert "manifest.json" in result["files"], result
    assert set(result["mismatched"]) == {"fastckpt vs state at save", "stock via FastFSDPStrategy vs state at save",
                                         "stock vs state at save"}, result

