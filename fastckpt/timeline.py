"""A picture of what checkpoints cost a training loop: step times, with each save's phases marked.

The top panel plots every training step's wall time against when it started; the bottom panel draws,
for each save, its blocking part (inside ``save()``), the wait of the next optimizer step for the lazy
copy, the staging (until the host copy was complete) and the persistence (until the checkpoint was
durable). matplotlib is imported only when a picture is drawn (``pip install fastckpt[demo]``).

What a checkpoint costs is measured as the benchmarks do: the run's steps are cut into windows, checkpointed
windows interleaved with clean ones, and each checkpointed window is compared with the mean of the clean windows
on either side of it, so a drift of the machine's speed cancels out instead of landing in the cost
(:func:`paired_costs`); :func:`verdict` says which plugin is cheaper only when the noise does not cover the
difference, and :func:`plot_cost` draws both costs on one scale.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError

__all__ = ["CLEAN", "MIN_WINDOWS", "SaveMark", "Window", "WindowCost", "median_and_noise", "paired_costs",
           "plot_cost", "plot_timeline", "verdict"]

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
    return _save(fig, path)


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


# ---- the cost of a checkpoint, from interleaved windows ---------------------------------------------------------

CLEAN = "clean"  # the kind of a window without checkpoints
MIN_WINDOWS = 3  # below this many paired windows a spread means nothing: no noise is stated, no verdict given
_SIGMAS = 2.0  # "the noise" printed and compared: two standard errors (about a 95% band)


@dataclass(frozen=True)
class Window:
    """``steps`` consecutive training steps from step index ``first``, all of one ``kind``: :data:`CLEAN`, a
    plugin's name (one checkpoint at its start, waited for at its end), or any other label (warm-up), never paired."""

    kind: str
    first: int
    steps: int


@dataclass(frozen=True)
class WindowCost:
    """What one plugin's checkpointed windows took beyond their clean neighbours: ms per checkpoint."""

    name: str
    extra_ms: tuple[float, ...]  # one paired difference per checkpointed window, in run order
    median_ms: float  # nan without windows
    noise_ms: float  # two standard errors of the median (inf below MIN_WINDOWS windows)
    clean_step_ms: float  # median step time of the clean windows it was compared with

    @property
    def measured(self) -> bool:
        """Whether there are enough windows for the noise to mean something."""
        return len(self.extra_ms) >= MIN_WINDOWS

    def describe(self) -> str:
        if not self.extra_ms:
            return f"{self.name}: no checkpointed window between two clean ones"
        noise = f"± {self.noise_ms:.1f}" if self.measured else f"(noise unknown: {len(self.extra_ms)} windows)"
        return f"{self.name} {self.median_ms:.1f} {noise} ms"


def median_and_noise(diffs: Sequence[float]) -> tuple[float, float]:
    """The median of ``diffs`` and one standard error of it, from their robust spread (1.4826 x MAD, x 1.2533 for a
    median): one scheduling hiccup in one window moves neither. The benchmarks use the same estimate."""
    if not diffs:
        raise ConfigError("median_and_noise needs at least one value")
    m = statistics.median(diffs)
    mad = statistics.median([abs(d - m) for d in diffs])
    return m, 1.2533 * 1.4826 * mad / math.sqrt(len(diffs))


def paired_costs(windows: Sequence[Window], step_ms: Sequence[float], kinds: Sequence[str]) -> list[WindowCost]:
    """One :class:`WindowCost` for each of ``kinds`` (in that order), from ``windows`` (run order) and the step
    times. A window of one of ``kinds`` counts when clean windows of its length sit right before and after it: its
    time minus their mean is one difference. Windows of other kinds (a warm-up) are never counted."""
    _check_windows(windows, step_ms)
    pairs: dict[str, list[float]] = {kind: [] for kind in kinds}
    clean_steps: dict[str, list[float]] = {kind: [] for kind in kinds}
    for before, window, after in zip(windows, windows[1:], windows[2:]):
        if window.kind not in pairs or before.kind != CLEAN or after.kind != CLEAN:
            continue
        if not before.steps == window.steps == after.steps:
            continue  # a shorter window (the run's last) would read as a saving
        neighbours = (_total(before, step_ms) + _total(after, step_ms)) / 2
        pairs[window.kind].append(_total(window, step_ms) - neighbours)
        clean_steps[window.kind].extend(step_ms[i] for w in (before, after) for i in range(w.first, w.first + w.steps))
    costs = []
    for kind, diffs in pairs.items():
        median, noise = math.nan, math.inf
        if diffs:
            median, se = median_and_noise(diffs)
            noise = _SIGMAS * se if len(diffs) >= MIN_WINDOWS else math.inf
        clean = statistics.median(clean_steps[kind]) if clean_steps[kind] else math.nan
        costs.append(WindowCost(kind, tuple(diffs), median, noise, clean))
    return costs


def verdict(first: WindowCost, second: WindowCost) -> str:
    """Which plugin's checkpoints cost less, by how much, or "inconclusive: ..." when the noise covers the
    difference (or there are too few windows to state the noise). One line, without the "verdict:" label."""
    n = min(len(first.extra_ms), len(second.extra_ms))
    if n < MIN_WINDOWS:
        return (f"inconclusive: {n} checkpointed windows per plugin between clean ones, {MIN_WINDOWS} are needed to "
                f"state the noise; train longer (--steps)")
    diff = second.median_ms - first.median_ms
    noise = math.hypot(first.noise_ms, second.noise_ms)
    if abs(diff) <= noise:
        return (f"inconclusive: the difference ({abs(diff):.1f} ms per checkpoint) is within the noise (± {noise:.1f} "
                f"ms); train longer (--steps) or on a quieter machine")
    cheaper, dearer = (first, second) if diff > 0 else (second, first)
    head = f"{cheaper.name} is cheaper by {abs(diff):.1f} ± {noise:.1f} ms per checkpoint"
    if cheaper.median_ms <= cheaper.noise_ms:
        return f"{head}; {cheaper.name}'s cost is within the noise of zero ({cheaper.describe()}), so no ratio"
    low = (dearer.median_ms - dearer.noise_ms) / (cheaper.median_ms + cheaper.noise_ms)
    high = (dearer.median_ms + dearer.noise_ms) / (cheaper.median_ms - cheaper.noise_ms)
    return (f"{head}: {dearer.name}'s checkpoints cost {dearer.median_ms / cheaper.median_ms:.1f}x as much "
            f"({low:.1f}x to {'unbounded' if high <= 0 else f'{high:.1f}x'} within the noise)")


def plot_cost(path: str | Path, step_starts: Sequence[float], step_ms: Sequence[float], windows: Sequence[Window],
              costs: Sequence[WindowCost] | Mapping[str, Sequence[WindowCost]], title: str = "") -> Path:
    """Write a PNG to ``path`` and return it: the step times with each window shaded by its kind (top), and each
    plugin's extra time per checkpoint on one millisecond scale (bottom): one dot per window, the median as a bar,
    the noise as an error bar, the figures written beside them. ``costs`` may also map a label to costs: one bottom
    panel per entry, side by side, the label as its axis (e.g. wall-clock ms, CPU ms, blocked ms per checkpoint)."""
    if len(step_starts) != len(step_ms) or not step_starts:
        raise ConfigError(f"plot_cost needs one start per step time and at least one step; got "
                          f"{len(step_starts)} starts and {len(step_ms)} times")
    _check_windows(windows, step_ms)
    panels = dict(costs) if isinstance(costs, Mapping) else {"extra ms per checkpoint": costs}
    if not panels:
        raise ConfigError("plot_cost needs at least one panel of costs; got an empty mapping")
    plt = _pyplot()
    colours = _kind_colours([w.kind for w in windows])
    fig = plt.figure(figsize=(max(10, 4.2 * len(panels)), 6.5))
    grid = fig.add_gridspec(2, len(panels), height_ratios=(3, 2))
    top = fig.add_subplot(grid[0, :])
    origin = step_starts[0]
    ends = [*step_starts[1:], step_starts[-1] + step_ms[-1] / 1e3]
    for w in windows:
        if w.kind != CLEAN:
            top.axvspan(step_starts[w.first] - origin, ends[w.first + w.steps - 1] - origin,
                        color=colours[w.kind], alpha=0.25, linewidth=0)
    top.plot([t - origin for t in step_starts], step_ms, color="#444444", linewidth=0.8, marker=".", markersize=3)
    top.set_ylabel("step time (ms)")
    top.set_xlabel("time since the first step (s); shaded: a checkpoint's window, white: clean")
    top.set_title(title or "training step times in interleaved windows")
    top.legend([plt.Rectangle((0, 0), 1, 1, color=colours[k], alpha=0.4) for k in colours], list(colours),
               loc="upper right", fontsize=7, ncol=len(colours))
    for column, (label, panel) in enumerate(panels.items()):
        _draw_costs(fig.add_subplot(grid[1, column]), panel, colours, label)
    caption = ("a checkpointed window minus its clean neighbours (dots: windows; bar: median; error bar: the noise)"
               if not isinstance(costs, Mapping) else
               "per checkpoint: a dot per checkpointed window, the median as a bar, its noise as an error bar")
    fig.suptitle(caption, fontsize=9, y=0.015, va="bottom")
    return _save(fig, path, rect=(0, 0.03, 1, 1))  # room for the caption at the bottom


def _draw_costs(axes: Any, costs: Sequence[WindowCost], colours: dict[str, str], label: str) -> None:
    """One panel: each plugin's values per window (dots), their median (bar) and noise (error bar), one scale."""
    values = [0.0]
    for i, cost in enumerate(costs):
        colour = colours.get(cost.name, "#444444")
        axes.scatter([i] * len(cost.extra_ms), cost.extra_ms, color=colour, s=14, alpha=0.6, zorder=3)
        if cost.extra_ms:
            noise = cost.noise_ms if cost.measured else 0.0
            axes.bar(i, cost.median_ms, width=0.5, color=colour, alpha=0.5, yerr=noise, capsize=6, zorder=2)
            axes.annotate(cost.describe().removeprefix(cost.name + " "), (i + 0.3, cost.median_ms), fontsize=8,
                          va="center")
            values += [*cost.extra_ms, cost.median_ms + noise, cost.median_ms - noise]
    axes.axhline(0.0, color="#444444", linewidth=0.6)
    span = max(values) - min(values) or 1.0
    axes.set_ylim(min(values) - 0.1 * span, max(values) + 0.1 * span)  # every dot and bar of every plugin shows
    axes.set_xticks(range(len(costs)), [c.name for c in costs], fontsize=8)
    axes.set_xlim(-0.6, len(costs) - 0.4 + 0.9)
    axes.set_ylabel(label)


def _check_windows(windows: Sequence[Window], step_ms: Sequence[float]) -> None:
    for w in windows:
        if w.steps < 1 or w.first < 0 or w.first + w.steps > len(step_ms):
            raise ConfigError(f"window {w} lies outside the {len(step_ms)} step times given; windows hold at least "
                              f"one step, between 0 and the number of steps")


def _total(window: Window, step_ms: Sequence[float]) -> float:
    return sum(step_ms[window.first:window.first + window.steps])


def _kind_colours(kinds: Sequence[str]) -> dict[str, str]:
    palette = ["#e6550d", "#3182bd", "#31a354", "#756bb1", "#969696"]
    named = [k for k in dict.fromkeys(kinds) if k != CLEAN]
    return {k: palette[i % len(palette)] for i, k in enumerate(named)}


def _save(fig: Any, path: str | Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> Path:
    """Write ``fig`` to ``path`` (its folder made) and free it: pyplot keeps every open figure alive. ``rect``: the
    part of the figure the axes may fill (the rest is left to a caption)."""
    fig.tight_layout(rect=rect)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path
