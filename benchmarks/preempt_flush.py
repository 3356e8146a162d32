"""How long the final checkpoint of a preemption takes for the benchmark state (1.48 GB: BENCHMARKS.md).

``python -m benchmarks.preempt_flush [ROOT]``: trains the GPT-2-small-shaped workload two steps, saves once (left
pending), then raises SIGUSR1 (configured as the preemption signal, with a Python handler installed before, so the
process survives to report) and steps: the step pre-hook takes the final checkpoint and flushes both. Prints the
seconds from the signal to the hand-on, and ``Preemption.flush_s`` (the save and the flush).
"""
from __future__ import annotations

import json
import signal
import sys
import tempfile
import threading
import time

import fastckpt
from benchmarks import workload


def main(argv: list[str]) -> int:
    workload.setup_threads()
    root = argv[0] if argv else tempfile.mkdtemp(prefix="preempt-flush-")
    model, opt = workload.build(workload.FULL)
    batches = workload.Batches(workload.FULL)
    for _ in range(2):
        workload.train_step(model, opt, batches)
    handed_on = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: handed_on.set())
    cfg = fastckpt.CheckpointConfig.from_dict({"root": root, "preemption": {
        "enabled": True, "signals": ["SIGUSR1"], "grace_s": 120}})
    with fastckpt.Checkpointer(cfg) as ckpt:
        ckpt.watch(opt)
        step = 2
        ckpt.preemption.on_preempt(lambda: (workload.make_state(model, opt, step), step))
        state_bytes = workload.tensor_bytes(workload.make_state(model, opt, step))
        ckpt.save(workload.make_state(model, opt, step), step)  # pending when the signal comes
        t0 = time.perf_counter()
        signal.raise_signal(signal.SIGUSR1)
        workload.train_step(model, opt, batches)  # the step pre-hook: final checkpoint, flush, hand-on
        total = time.perf_counter() - t0
        assert handed_on.is_set() and ckpt.latest() == step
        print(json.dumps({"state_bytes": state_bytes, "signal_to_hand_on_s": round(total, 2),
                          "flush_s": round(ckpt.preemption.flush_s or 0.0, 2), "root": root}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
