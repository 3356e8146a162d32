"""fastckpt's benchmarks: ``python -m benchmarks.run`` (BENCHMARKS.md says what each part measures)."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["REPO", "repo_env"]

REPO = Path(__file__).resolve().parent.parent


def repo_env(**extra: str) -> dict[str, str]:
    """The environment of a measuring subprocess: this one's, with the repository first on ``PYTHONPATH`` (a
    checkout benchmarked from anywhere imports its own ``fastckpt`` and ``benchmarks``), plus ``extra``."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
