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
