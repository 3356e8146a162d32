"""docs/DESIGN.md's module tables ("Who owns what") are generated from the modules' docstrings; they must match."""

from __future__ import annotations

from pathlib import Path

from tools import designref

REPO = Path(__file__).resolve().parents[1]


def test_committed_tables_match_the_code() -> None:
    assert (REPO / "docs" / "DESIGN.md").read_text() == designref.render(), (
        "docs/DESIGN.md's module tables are out of date: run `python -m tools.designref`")


def test_every_module_opens_with_a_line_saying_what_it_owns() -> None:
    missing = [str(path.relative_to(REPO)) for package in designref.PACKAGES for path in designref.modules(package)
               if not designref.first_line(path)]
    assert missing == [], ("these modules have no docstring (or an empty first line); open each with one line "
                           "saying what it owns:\n" + "\n".join(missing))


def test_every_module_and_folder_has_a_row() -> None:
    text = designref.tables()
    for package in designref.PACKAGES:
        base = REPO / package
        for path in designref.modules(package):
            if path.name == "__init__.py" and path.parent != base:
                assert f"`{package}/{path.parent.name}/`: " in text, path  # a folder: its role heads its table
            else:
                assert f"| `{path.relative_to(base).as_posix()}` | " in text, path


def test_check_mode_fails_on_drift_and_names_the_fix(tmp_path: Path, capsys) -> None:
    out = tmp_path / "DESIGN.md"
    out.write_text(designref.render())
    assert designref.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text().replace("| `errors.py` |", "| `errs.py` |"))
    assert designref.main(["--check", "--out", str(out)]) == 1
    assert "python -m tools.designref" in capsys.readouterr().err
    assert designref.main(["--out", str(out)]) == 0  # regenerating fixes it
    assert designref.main(["--check", "--out", str(out)]) == 0
    assert out.read_text() == designref.render()
