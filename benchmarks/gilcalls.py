"""How many times a checkpoint's background threads take the GIL back: ``python -m benchmarks.gilcalls [--quick]
[--checkpoints N] [--hurry] [--config JSON] [--json PATH]``.

Each time a background thread returns from a native call that released the GIL, it asks for it back, and a
launch-bound training thread (a GPU job's) hands it over and waits for the background's Python until its next
native call. So the count of GIL hand-overs a checkpoint makes is what the training thread pays for, whatever the
host's noise: a figure that a busy machine does not move. It is counted by an ``LD_PRELOAD`` shim over
``PyEval_SaveThread`` (benchmarks/gilcount/gilcount.c, built here with the C compiler, per thread), which every
extension (torch, ctypes, crc32c) calls to release the GIL; libpython's own releases (``os.pwrite``) are not seen.

W1 (the GPT-2-small shape + AdamW, 1.48 GB, 580 tensors) is saved ``--checkpoints`` times after a warm-up save, the
training thread waiting for staging right away (``--hurry``: the copy thread then stages plainly and the I/O
workers measure) or only once the copy thread is done (the default: the one pass). Prints, per checkpoint, the
hand-overs of each thread kind and of ``save()`` on the training thread. ``--cuda``: the model and its optimizer
state on the GPU, so the CUDA path is counted (engine/cudacopy.py: a few calls a shard and device, not ten a
tensor); ``--config '{"staging": {"device_snapshot": "on"}}'`` counts it with a device snapshot.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from . import REPO, repo_env

SHIM_SRC = REPO / "benchmarks" / "gilcount" / "gilcount.c"


def build_shim(out_dir: Path) -> Path | None:
    """Compile the shim into ``out_dir``; None where no C compiler is installed."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    lib = out_dir / "libgilcount.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(SHIM_SRC), "-ldl"], check=True)
    return lib


def _kind(name: str) -> str:
    """A thread's kind: its name without the numbers (``fastckpt-io-1_0`` -> ``fastckpt-io``)."""
    return "-".join(p for p in name.split("_")[0].split("-") if not p.isdigit()) or name


def measure(checkpoints: int, hurry: bool, quick: bool, config: dict[str, Any], cuda: bool = False) -> dict[str, Any]:
    """In this process (started with the shim preloaded): the hand-overs per checkpoint, by thread kind."""
    import torch

    from fastckpt import CheckpointConfig, Checkpointer

    from .workload import FULL, QUICK, Batches, build, loss_fn, make_state, tensor_bytes, train_step, unique_tensors

    shim = ctypes.PyDLL(os.environ["FASTCKPT_GILCOUNT"])  # PyDLL: reading the count releases nothing itself
    shim.gilcount_of.restype = ctypes.c_long
    shim.gilcount_of.argtypes = [ctypes.c_long]
    torch.set_num_threads(1)
    shape = QUICK if quick else FULL
    model, opt = build(shape)
    if cuda:  # moved in place: the optimizer keeps the parameters, and its state is made on the GPU by the step
        model.cuda()
        x, y = Batches(shape).next()
        loss_fn(model, x.cuda(), y.cuda()).backward()
        opt.step()
        torch.cuda.synchronize()
    else:
        train_step(model, opt, Batches(shape))
    state = make_state(model, opt, 0)

    def counts() -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for t in threading.enumerate():
            if t.native_id is not None and t is not threading.current_thread():
                out[_kind(t.name)] += shim.gilcount_of(t.native_id)
        return out

    me = threading.get_native_id()
    per: list[dict[str, int]] = []
    with tempfile.TemporaryDirectory(prefix="gilcalls-") as root:
        ck = Checkpointer(CheckpointConfig(root=root, **config))
        ck.watch(opt)
        ck.prewarm(state).result()  # buffers, layouts and the compiled pass (format/fused.py) ready, as users do
        for k in range(checkpoints + 1):
            before, mine = counts(), shim.gilcount_of(me)
            handle = ck.save(state, k + 1)
            in_save = shim.gilcount_of(me) - mine
            if hurry:
                handle.wait_staged()
            else:
                handle.wait_copied()  # unhurried (wait_staged hurries): the copy thread keeps its one pass
            ck.wait()
            after = counts()
            if k:  # the first is the warm-up (layouts and buffers made)
                row = {kind: after[kind] - before[kind] for kind in after if after[kind] - before[kind]}
                row["save() (training thread)"] = in_save
                per.append(row)
        ck.close()
    return {"nbytes": tensor_bytes(state), "tensors": len(unique_tensors(state)), "hurry": hurry,
            "config": config, "cuda": cuda, "per_checkpoint": per}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoints", type=int, default=3)
    ap.add_argument("--hurry", action="store_true", help="wait for staging right after save()")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cuda", action="store_true", help="the state on the GPU: count the CUDA path")
    ap.add_argument("--config", default="{}", help="CheckpointConfig overrides, as JSON")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inside:
        print("RESULT " + json.dumps(measure(args.checkpoints, args.hurry, args.quick, json.loads(args.config),
                                             args.cuda)))
        return 0
    with tempfile.TemporaryDirectory(prefix="gilcount-") as tmp:
        lib = build_shim(Path(tmp))
        if lib is None:
            print("gilcalls: no C compiler (cc/gcc/clang) to build the counting shim; install one", file=sys.stderr)
            return 2
        cmd = [sys.executable, "-m", "benchmarks.gilcalls", "--inside", "--checkpoints", str(args.checkpoints),
               "--config", args.config] + (["--hurry"] if args.hurry else []) + (["--quick"] if args.quick else []) \
            + (["--cuda"] if args.cuda else [])
        env = repo_env(LD_PRELOAD=str(lib), FASTCKPT_GILCOUNT=str(lib))
        out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print(out.stderr[-2000:], file=sys.stderr)
        return 1
    res = json.loads(line[7:])
    for k, row in enumerate(res["per_checkpoint"]):
        total = sum(v for key, v in row.items() if not key.startswith("save()"))
        print(f"checkpoint {k + 1}: background {total} hand-overs " + json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
