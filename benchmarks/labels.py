"""Lines the report's sections share, below both the report and the modules that render a section of it."""
from __future__ import annotations

from typing import Any

__all__ = ["own_run_label"]


def own_run_label(meta: dict[str, Any] | None) -> list[str]:
    """The line that labels a section measured by a later run of its own (``--merge-into``), or nothing."""
    if not meta:
        return []
    return [f"> Measured by its own {'QUICK smoke ' if meta.get('quick') else ''}run: `{meta.get('command')}` "
            f"on {meta.get('started')} "
            f"({meta.get('cpu')}, {meta.get('logical_cpus')} logical cores, fastckpt git "
            f"{meta.get('git', {}).get('commit', '?')}; load average {meta.get('loadavg_start', [0])[0]:.1f} at "
            f"the start and {meta.get('loadavg_end', [0])[0]:.1f} at the end), not by the run above. Compare "
            "ratios, not absolute times.", ""]
