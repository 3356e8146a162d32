"""A picture of what checkpoints cost a training loop: step times, with each save's phases marked.

The top panel plots every training step's wall time against when it started; the bottom panel draws,
for each save, its blocking part (inside ``save()``), the wait of the next optimizer step for the lazy
copy, the staging (until the host copy was complete) and the persistence (until the checkpoint was
durable). matplotlib is imported only when a picture is drawn (``pip install fastckpt[demo]``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["SaveMark", "plot_timeline"]

# phase -> colour; the order is the drawing order (longest phase first, so the short ones stay visible)
_PHASES = {"persist": "#9ecae1", "staging": "#fdae6b", "waited": "#e6550d", "blocking": "#a50f15"}


@dataclass(frozen=True)
class SaveMark:
    """One save on the timeline: when ``save()`` was called (seconds, same clock as the steps) and its figures."""

    start_s: float
    stats: Any  # a fastckpt SaveStats or a Lightning CheckpointStats: blocking_ms, waited_ms, staging_ms, persist_s
    label: str = ""


def plot_timeline(path: str | Path, step_starts: Sequence[float], step_ms: Sequence[float],
                  saves: Sequence[SaveMark], title: str = "") -> Path:
    """Write the PNG to ``path`` and return it. ``step_starts[i]`` is when step i began (seconds),
    ``step_ms[i]`` how long it took."""
    if len(step_starts) != len(step_ms) or not step_starts:
        raise ConfigError(f"plot_timeline needs one start per step time and at least one step; got "
                          f"{len(step_starts)} starts and {len(step_ms)} times")
    plt = _pyplot()
    origin = step_starts[0]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 5.5), height_ratios=(3, 2))
    top.plot([t - origin for t in step_starts], step_ms, color="#444444", linewidth=0.8, marker=".", markersize=3)
    top.set_ylabel("step time (ms)")
    top.set_title(title or "training step times, with each checkpoint's phases")
    for row, save in enumerate(saves):
        start = save.start_s - origin
        top.axvline(start, color=_PHASES["blocking"], linewidth=0.6, alpha=0.5)
        _draw_save(bottom, row, start, save.stats)
    bottom.set_yticks(range(len(saves)), [s.label for s in saves], fontsize=7)
    bottom.set_ylim(len(saves) + 0.9, -0.6)  # top to bottom, with a free row at the bottom for the legend
    bottom.set_xlabel("time since the first step (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _PHASES.values()]
    bottom.legend(handles, [f"{name}" for name in _PHASES], loc="lower right", fontsize=7, ncol=4)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_save(axes: Any, row: int, start: float, stats: Any) -> None:
    """The phases of one save as bars on ``row``. The optimizer step's wait for the lazy copy ends when
    staging does, so it is drawn as the last ``waited_ms`` of the staging bar."""
    staging, waited = stats.staging_ms / 1e3, stats.waited_ms / 1e3
    spans = {"persist": (start, stats.persist_s), "staging": (start, staging),
             "blocking": (start, stats.blocking_ms / 1e3), "waited": (start + max(staging - waited, 0.0), waited)}
    for phase, colour in _PHASES.items():
        begin, width = spans[phase]
        axes.barh(row, max(width, 1e-4), left=begin, height=0.6, color=colour)


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as e:
        raise ConfigError("the timeline needs matplotlib: pip install 'fastckpt[demo]' (or matplotlib)") from e
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt
