"""Layers point down: no module of the fastckpt packages imports another module's private (``_``) name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fastckpt", "fastckpt_lightning", "fastckpt_accelerate")


def _private_imports(path: Path) -> list[str]:
    """``module: name`` of every ``from <our package or relative> import _name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom):
            continue
        ours = node.level > 0 or (node.module or "").split(".")[0] in PACKAGES
        for alias in node.names:
            if ours and alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {'.' * node.level}{node.module} {alias.name}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_private_name_is_imported_across_modules(package):
    modules = sorted((ROOT / package).glob("*.py"))
    assert modules, f"no modules found under {ROOT / package}"
    reaches = [line for module in modules for line in _private_imports(module)]
    assert reaches == [], "give these helpers a public home below both modules:\n" + "\n".join(reaches)
