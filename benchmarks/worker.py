"""Run one benchmark task in this process: ``python -m benchmarks.worker TASK ARGS_JSON RESULT_JSON``.

``run.py`` starts one worker per measure and peer so that one peer's memory (and allocator/page-cache
state) does not pollute another's. ``run_inline`` does the same thing in the calling process (``--quick``).
"""
from __future__ import annotations

import json
import sys
import traceback
from typing import Any, Callable


def _tasks() -> dict[str, Callable[..., dict[str, Any]]]:
    from . import breakdown, busy, frameworks, measure, restore, restore_cold

    return {
        "calibrate": measure.task_calibrate,
        "core": measure.task_core,
        "io": measure.task_io,
        "rss": measure.task_rss,
        "busy": busy.task_busy,
        "breakdown": breakdown.task_breakdown,
        "lightning": frameworks.task_lightning,
        "lightning_load": frameworks.task_lightning_load,
        "accelerate": frameworks.task_accelerate,
        "restore_save": restore.task_restore_save,
        "restore_load": restore.task_restore_load,
        "restore_shm_save": restore.task_restore_shm_save,
        "restore_memcpy": restore.task_restore_memcpy,
        "restore_raw_read": restore.task_restore_raw_read,
        "restore_s3_whole": restore.task_restore_s3_whole,
        "restore_cold_save": restore_cold.task_restore_cold_save,
    }


def run_inline(task: str, args: dict[str, Any]) -> dict[str, Any]:
    try:
        return {"ok": True, "result": _tasks()[task](**args)}
    except BaseException as e:  # noqa: BLE001 - reported as "n/a (error: ...)"
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def main(argv: list[str]) -> int:
    task, args_json, out_path = argv
    res = run_inline(task, json.loads(args_json))
    if not res["ok"]:
        print(res["traceback"], file=sys.stderr, flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
