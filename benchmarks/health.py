"""What the health statistics cost: persist time of one ~537 MB save with ``health.enabled`` off and on.

The statistics (fastckpt/format/health.py) run on the I/O workers, on the staged copy: ``blocking_ms`` (the time
inside ``save()``) and the copy the next ``optimizer.step()`` waits for (``wait_staged``) must not change; only
``persist_s`` may grow. ``python -m benchmarks.health [ROOT_PARENT] [--priority idle|low|normal] [--reps N]``
prints the medians (the root defaults to /dev/shm, so the disk does not drown the difference; fsync off).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from fastckpt import CheckpointConfig, Checkpointer

__all__ = ["measure"]


def measure(parent: str = "/dev/shm", priority: str = "idle", reps: int = 3, layers: int = 8) -> dict[str, Any]:
    """Medians over ``reps`` saves of ``layers`` 4096x4096 float32 Linear layers, health off and on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
    for _ in range(reps):
        for enabled in (False, True):
            root = tempfile.mkdtemp(dir=parent)
            try:
                config = CheckpointConfig(root=root, health={"enabled": enabled},
                                          persist={"fsync": False, "priority": priority})
                with Checkpointer(config) as ckpt:
                    ckpt.watch(opt)
                    handle = ckpt.save({"model": model.state_dict()}, step=1)
                    t0 = time.perf_counter()
                    ckpt.wait_staged()  # what the next optimizer.step() waits for
                    waited_ms = (time.perf_counter() - t0) * 1e3
                    handle.wait()
                    runs[enabled].append((handle.stats.persist_s, handle.stats.blocking_ms, waited_ms))
            finally:
                shutil.rmtree(root, ignore_errors=True)
    state_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out: dict[str, Any] = {"state_bytes": state_bytes, "priority": priority, "reps": reps}
    for enabled, rows in runs.items():
        key = "health_on" if enabled else "health_off"
        out[key] = {"persist_s": statistics.median(r[0] for r in rows),
                    "blocking_ms": statistics.median(r[1] for r in rows),
                    "wait_staged_ms": statistics.median(r[2] for r in rows)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parent", nargs="?", default="/dev/shm")
    parser.add_argument("--priority", default="idle", choices=("idle", "low", "normal"))
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    res = measure(args.parent, args.priority, args.reps)
    print(f"state {res['state_bytes'] / 1e6:.0f} MB, persist.priority={res['priority']}, median of {res['reps']}:")
    for key in ("health_off", "health_on"):
        r = res[key]
        print(f"  {key:10s} persist_s {r['persist_s']:.3f}  blocking_ms {r['blocking_ms']:.2f}  "
              f"wait_staged_ms {r['wait_staged_ms']:.1f}")


if __name__ == "__main__":
    main()
