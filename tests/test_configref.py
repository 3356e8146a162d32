"""docs/CONFIG.md is generated from the config dataclasses; it must match the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("accelerate")

from tools import configref  # noqa: E402
from fastckpt.config import SECTIONS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_committed_reference_matches_the_code() -> None:
    assert (REPO / "docs" / "CONFIG.md").read_text() == configref.render(), (
        "docs/CONFIG.md is out of date: run `python -m tools.configref`")


def test_every_field_is_documented_with_type_default_and_allowed_values() -> None:

    text = configref.render()
    for prefix, cls in configref.SECTIONS:
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS:  # a nested section: its fields have their own rows
                continue
            row = next((line for line in text.splitlines() if line.startswith(f"| `{prefix}{f.name}` |")), None)
            assert row is not None, f"{prefix}{f.name} missing"
            cells = [cell.strip() for cell in row.strip("|").split(" | ")]
            assert len(cells) == 5 and all(cells), (prefix + f.name, cells)  # type, default, rule, why: none empty
    assert "| `persist.priority` | `str` | `'normal'` | `idle`, `low`, `normal` |" in text
    assert "| `staging.max_host_bytes` | `int \\| None` | `null` | integer >= 1, or `null` |" in text
    assert "| `persist.fsync` | `bool` | `true` | `true`, `false` |" in text


def test_check_mode_fails_on_drift_and_names_the_fix(tmp_path: Path, capsys) -> None:
    out = tmp_path / "CONFIG.md"
    out.write_text(configref.render())
    assert configref.main(["--check", "--out", str(out)]) == 0
    out.write_text(configref.render().replace("| `persist.workers` | `int` | `2` |", "| `persist.workers` | `int` | `8` |"))
    assert configref.main(["--check", "--out", str(out)]) == 1
    assert "python -m tools.configref" in capsys.readouterr().err
    assert configref.main(["--out", str(out)]) == 0  # regenerating fixes it
    assert configref.main(["--check", "--out", str(out)]) == 0
