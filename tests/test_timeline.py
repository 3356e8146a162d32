"""fastckpt.timeline draws step times and each save's phases into a PNG."""

from __future__ import annotations

import builtins
from pathlib import Path

import pytest

from fastckpt import SaveStats
from fastckpt.errors import ConfigError
from fastckpt.timeline import SaveMark, plot_timeline


def test_timeline_writes_a_png_with_every_phase(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    starts = [i * 0.1 for i in range(20)]
    step_ms = [100.0] * 20
    stats = SaveStats(step=5, name="a", blocking_ms=3.0, staging_ms=40.0, waited_ms=12.0, persist_s=0.8, nbytes=10)
    written = plot_timeline(tmp_path / "sub" / "t.png", starts, step_ms, [SaveMark(0.5, stats, "5 a")])
    assert written == tmp_path / "sub" / "t.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_without_matplotlib_says_how_to_install_it(tmp_path: Path, monkeypatch) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ConfigError, match=r"fastckpt\[demo\]"):
        plot_timeline(tmp_path / "t.png", [0.0], [1.0], [])
    assert not (tmp_path / "t.png").exists()


def test_timeline_refuses_mismatched_inputs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one start per step time"):
        plot_timeline(tmp_path / "t.png", [0.0, 1.0], [1.0], [])


# ---- the cost of a checkpoint from interleaved windows (issue 23 item 8) ------------------------------------------

from fastckpt.timeline import CLEAN, Window, paired_costs, plot_cost, verdict  # noqa: E402


def interleaved(extra: dict[str, list[float]], wobble: list[float], every: int = 2) -> tuple[list[Window], list[float]]:
    """A warm-up window, then clean / kind / clean / kind ... / clean; each checkpointed window's first step takes
    ``extra`` more; ``wobble`` (one value per window) shifts every step of a window (a drifting machine)."""
    kinds = [k for pair in zip(*([k] * len(v) for k, v in extra.items())) for k in pair]
    order = ["warm-up"] + [k for kind in kinds for k in (CLEAN, kind)] + [CLEAN]
    windows = [Window(kind, i * every, every) for i, kind in enumerate(order)]
    steps = [100.0 + wobble[i % len(wobble)] for i in range(len(order)) for _ in range(every)]
    seen = {k: 0 for k in extra}
    for w in windows:
        if w.kind in extra:
            steps[w.first] += extra[w.kind][seen[w.kind]]
            seen[w.kind] += 1
    return windows, steps


def test_paired_costs_cancel_a_drift_and_state_the_noise() -> None:
    # the machine slows down steadily (+3 ms per window): a plain "checkpointed minus clean" would include it
    windows, steps = interleaved({"fast": [5.0, 6.0, 4.0, 5.0], "async": [40.0, 42.0, 38.0, 41.0]},
                                 [3.0 * i for i in range(40)])
    fast, slow = paired_costs(windows, steps, ["fast", "async"])
    assert fast.extra_ms == (5.0, 6.0, 4.0, 5.0) and slow.extra_ms == (40.0, 42.0, 38.0, 41.0)
    assert fast.median_ms == 5.0 and slow.median_ms == 40.5
    assert 0 < fast.noise_ms < 5 and 0 < slow.noise_ms < 5
    said = verdict(fast, slow)
    assert said.startswith("fast is cheaper by 35.5 ± "), said
    assert "async's checkpoints cost 8.1x as much" in said, said


def test_verdict_is_inconclusive_when_the_noise_covers_the_difference() -> None:
    windows, steps = interleaved({"fast": [5.0, 30.0, 12.0, -8.0, 20.0], "async": [9.0, -5.0, 28.0, 15.0, 1.0]}, [0.0])
    fast, slow = paired_costs(windows, steps, ["fast", "async"])
    said = verdict(fast, slow)
    assert said.startswith("inconclusive: the difference (3.0 ms per checkpoint) is within the noise (± "), said


def test_verdict_states_no_noise_from_too_few_windows_and_no_ratio_over_zero() -> None:
    windows, steps = interleaved({"fast": [1.0, 2.0], "async": [40.0, 41.0]}, [0.0])
    fast, slow = paired_costs(windows, steps, ["fast", "async"])
    assert not fast.measured and fast.noise_ms == float("inf")
    assert verdict(fast, slow).startswith("inconclusive: 2 checkpointed windows per plugin"), verdict(fast, slow)

    windows, steps = interleaved({"fast": [1.0, -2.0, 0.5, 2.0], "async": [40.0, 41.0, 39.0, 40.0]}, [0.0])
    fast, slow = paired_costs(windows, steps, ["fast", "async"])
    said = verdict(fast, slow)
    assert said.startswith("fast is cheaper by") and "within the noise of zero" in said and "no ratio" in said, said


def test_paired_costs_skip_windows_without_two_clean_neighbours_and_refuse_windows_outside_the_steps() -> None:
    windows = [Window("fast", 0, 2), Window(CLEAN, 2, 2), Window("fast", 4, 2), Window(CLEAN, 6, 2),
               Window("fast", 8, 2), Window(CLEAN, 10, 1)]  # the first has no clean window before it, the last a short one after
    steps = [100.0] * 11
    steps[4] += 7.0
    (fast,) = paired_costs(windows, steps, ["fast"])
    assert fast.extra_ms == (7.0,)
    with pytest.raises(ConfigError, match="outside the 3 step times"):
        paired_costs([Window(CLEAN, 2, 2)], [1.0, 2.0, 3.0], ["fast"])


def test_plot_cost_draws_both_plugins_on_one_scale(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    windows, steps = interleaved({"fastckpt": [1.0, 2.0, 1.5], "AsyncCheckpointIO": [300.0, 310.0, 290.0]}, [0.0])
    costs = paired_costs(windows, steps, ["fastckpt", "AsyncCheckpointIO"])
    starts = [sum(steps[:i]) / 1e3 for i in range(len(steps))]
    written = plot_cost(tmp_path / "c.png", starts, steps, windows, costs)
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_cost_draws_one_panel_per_labelled_figure(tmp_path: Path) -> None:
    """Issue 55, item 1: the demo draws the blocked, CPU and wall-clock figures per checkpoint, each on its scale."""
    pytest.importorskip("matplotlib")
    windows, steps = interleaved({"fastckpt": [1.0, 2.0, 1.5], "AsyncCheckpointIO": [300.0, 310.0, 290.0]}, [0.0])
    costs = paired_costs(windows, steps, ["fastckpt", "AsyncCheckpointIO"])
    starts = [sum(steps[:i]) / 1e3 for i in range(len(steps))]
    panels = {"blocked ms per checkpoint": costs, "CPU ms per checkpoint": costs, "wall-clock ms": costs}
    written = plot_cost(tmp_path / "c.png", starts, steps, windows, panels)
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    assert matplotlib.image.imread(written).shape[1] > 1100 * 1.1  # three panels side by side: a wider figure
    with pytest.raises(ConfigError, match="at least one panel"):
        plot_cost(tmp_path / "d.png", starts, steps, windows, {})
