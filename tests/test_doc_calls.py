"""Every call the docs' prose names runs as written (issue 54, item 8), not only the ```python blocks.

README.md and docs/*.md name calls in running text and in signatures (`fastckpt.consolidate(path)`,
`fastckpt.load_checkpoint(path, *, map_location=None, ...)`). tests/test_doc_snippets.py runs the python blocks;
here every fully qualified call outside them (``fastckpt.``, ``fastckpt_lightning.``, ``fastckpt_accelerate.``
followed by ``(``) is found, made executable as written and run in a fresh interpreter against a real checkpoint:

- the dotted name is resolved the way a reader's script does (attributes, importing a submodule where the name is
  one): a module, or anything else that is not callable, fails here as it fails for the reader;
- each argument the docs name is bound to a real value of that name (``FIXTURES``; a signature's defaults and
  literals are passed as written, ``...`` is dropped or, as a keyword's value, bound like a name), so a parameter
  the function does not take fails too;
- the result is checked where the docs say what it is (``CHECKS``).

A call whose context the reader sets up first (``should_checkpoint`` needs ``enable``) gets it from ``CONTEXT``.
Also: every dotted name the prose gives (a module, a class, a constant) resolves.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.doc_calls_child import resolve

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_NAME = r"(?<![\w./-])((?:fastckpt_lightning|fastckpt_accelerate|fastckpt)(?:\.[A-Za-z_]\w*)+)"
_CALL = re.compile(_NAME + r"\(")
_DOTTED = re.compile(_NAME)
_FILE_SUFFIXES = {"yaml", "yml", "json", "md", "py", "lock", "log", "txt", "ckpt"}  # `fastckpt.yaml`: a file
NOT_PYTHON = {"fastckpt.raw_dtypes"}  # a key of a safetensors file's __metadata__ (docs/FORMAT.md), not a name
_PYTHON_FENCE = re.compile(r"^```python\s*$")

# Each name a documented call passes, bound to a real value (Python source; ``WORK``: the run's folder, ``CKPT``:
# a committed checkpoint of ``STATE``). (dotted name, argument) overrides where a name means something else there.
FIXTURES: dict[str, str] = {
    "path": "path = CKPT",
    "url": "url = WORK + '/storage'",
    "options": "options = None",
    "storage_options": "storage_options = None",
    "cost_s": "cost_s = 30.0",
    "mtbf_s": "mtbf_s = 3600.0",
    "mtbf": "mtbf = lambda: 3600.0",
    "agree": "agree = lambda decision: decision",
    "clock": "import time; clock = time.monotonic",
    "accelerator": "import accelerate; accelerator = accelerate.Accelerator(cpu=True)",
    "config": "config = {'root': WORK + '/accelerate'}",
    "step": "step = 10",
    "storage": "storage = fastckpt.open_storage(CKPT)",
    "workers": "workers = 2",
    "ranges": ("from fastckpt.read.readers import Range\nfrom fastckpt.format.checksum import crc32c\n"
               "BLOB = os.urandom(8192)\nopen(WORK + '/blob', 'wb').write(BLOB)\nOUT = bytearray(len(BLOB))\n"
               "ranges = [Range(WORK + '/blob', 0, memoryview(OUT), crc32c(BLOB), what='blob')]"),
}
OVERRIDES: dict[tuple[str, str], str] = {
    ("fastckpt.Cadence", "options"): "from fastckpt.configtime import CadenceOptions\n"
                                     "options = CadenceOptions(interval=10)",
}
_ENABLED = "fastckpt_accelerate.enable(accelerator, {'root': WORK + '/enabled', 'cadence': {'interval': 10}})"
CONTEXT: dict[str, str] = {  # what the docs have the reader do before the call
    "fastckpt_accelerate.should_checkpoint": _ENABLED,
    "fastckpt_accelerate.cadence_stats": _ENABLED,
    "fastckpt_accelerate.get_checkpointing": _ENABLED,
}
CHECKS: dict[str, str] = {  # what the docs say the call gives
    "fastckpt.consolidate": "assert_bit_equal(result, STATE)",
    "fastckpt.load_checkpoint": "assert_bit_equal(result, STATE)",
    "fastckpt.is_checkpoint": "assert result is True",
    "fastckpt.young_daly": "assert result == (2 * 30.0 * 3600.0) ** 0.5",
    "fastckpt.open_storage": "assert result.url.rstrip('/').endswith('storage')",
    "fastckpt.read.readers.read_ranges": "assert result == len(BLOB) and bytes(OUT) == BLOB",
    "fastckpt_accelerate.should_checkpoint": "assert result is True  # step 10, interval 10",
    "fastckpt_accelerate.get_checkpointing": "assert result is not None and not result.closed",
}
_TEARDOWN = """
_acc = globals().get("accelerator")
if _acc is not None:
    _on = fastckpt_accelerate.get_checkpointing(_acc)
    if _on is not None and not _on.closed:
        _on.close()
"""


@dataclass(frozen=True)
class Call:
    doc: str
    line: int
    dotted: str
    args: str  # as written between the parentheses, whitespace collapsed

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}: {self.dotted}({self.args})"


def prose(path: Path) -> str:
    """``path``'s text with its ```python blocks blanked (line numbers kept): test_doc_snippets runs those."""
    lines = path.read_text(encoding="utf-8").splitlines()
    inside = False
    for i, line in enumerate(lines):
        if inside and line.strip() == "```":
            inside = False
            lines[i] = ""
        elif inside or _PYTHON_FENCE.match(line):
            inside = True
            lines[i] = ""
    return "\n".join(lines)


def _closing(text: str, start: int) -> int | None:
    """The index of the ``)`` closing the ``(`` at ``start - 1`` (brackets and quotes respected), or None."""
    depth, quote = 1, None
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return None


def calls_in(text: str, doc: str) -> list[Call]:
    found = []
    for match in _CALL.finditer(text):
        end = _closing(text, match.end())
        if end is None:
            raise AssertionError(f"{doc}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(1)}( never closes")
        args = " ".join(text[match.end():end].split())
        found.append(Call(doc, text.count("\n", 0, match.start()) + 1, match.group(1), args))
    return found


def documented_calls() -> list[Call]:
    return [c for path in DOCS for c in calls_in(prose(path), path.relative_to(REPO).as_posix())]


def executable(call: Call) -> tuple[str, list[str]]:
    """The call as an expression over its argument names (``_resolve`` finds the function), and those names."""
    args = re.sub(r"(^|,)\s*[*/]\s*(?=,|$)", "", call.args)  # a signature's bare ``*`` (or ``/``) marker
    try:
        tree = ast.parse(f"f({args})", mode="eval").body
    except SyntaxError as e:
        raise AssertionError(f"{call.id}: not Python call syntax ({e.msg}); write the call as code") from e
    assert isinstance(tree, ast.Call)
    names: list[str] = []

    def bound(node: ast.expr, name: str | None) -> ast.expr:
        if isinstance(node, ast.Name):
            names.append(node.id)
            return node
        if isinstance(node, ast.Constant) and node.value is Ellipsis and name is not None:
            names.append(name)  # ``mtbf=...``: a value of that name
            return ast.Name(name, ast.Load())
        return node

    positional = [bound(a, None) for a in tree.args
                  if not (isinstance(a, ast.Constant) and a.value is Ellipsis)]  # ``f(a, ...)``: and more
    keywords = [ast.keyword(k.arg, bound(k.value, k.arg)) for k in tree.keywords]
    func = ast.Call(ast.Name("_resolve", ast.Load()), [ast.Constant(call.dotted)], [])
    expr = ast.fix_missing_locations(ast.Expression(ast.Call(func, positional, keywords)))
    return ast.unparse(expr), names


def setup_for(call: Call, names: list[str]) -> str:
    missing = [n for n in names if (call.dotted, n) not in OVERRIDES and n not in FIXTURES]
    if missing:
        raise AssertionError(f"{call.id}: no value for {missing}: add it to FIXTURES in tests/test_doc_calls.py")
    lines = [OVERRIDES.get((call.dotted, n), FIXTURES.get(n, "")) for n in dict.fromkeys(names)]
    if call.dotted in CONTEXT:
        lines.append(CONTEXT[call.dotted])
    return "\n".join(lines)


PRELUDE = """
import os
import torch
import fastckpt, fastckpt_lightning, fastckpt_accelerate
from tests.helpers import assert_bit_equal
from tests.doc_calls_child import resolve as _resolve
WORK, CKPT = {work!r}, {ckpt!r}
STATE = torch.load({state!r}, weights_only=True)
"""


def test_the_prose_names_calls_and_finds_them_all() -> None:
    calls = documented_calls()
    assert len(calls) >= 12, [c.id for c in calls]
    found = {c.dotted for c in calls}
    assert {"fastckpt.consolidate", "fastckpt.load_checkpoint", "fastckpt_accelerate.should_checkpoint"} <= found
    assert not [c for c in calls if c.dotted == "fastckpt.read.consolidate"]  # the module: issue 54, item 8
    text = "see `fastckpt.read.consolidate(path)` and\n`fastckpt.load_checkpoint(path, *,\n  verify=True)`."
    assert [(c.line, c.dotted, c.args) for c in calls_in(text, "x.md")] == [
        (1, "fastckpt.read.consolidate", "path"), (2, "fastckpt.load_checkpoint", "path, *, verify=True")]


def test_a_module_named_as_a_function_fails_as_it_does_for_the_reader() -> None:
    with pytest.raises(TypeError, match="fastckpt.read.consolidate is a module, not callable"):
        resolve("fastckpt.read.consolidate")
    assert resolve("fastckpt.consolidate") is resolve("fastckpt.read.consolidate.consolidate")


@pytest.mark.timeout(300)
def test_every_documented_call_runs_as_written(tmp_path: Path) -> None:
    from fastckpt import CheckpointConfig, Checkpointer

    state = {"model": {"w": torch.randn(16, 4), "b": torch.arange(4.0)}, "step": torch.tensor(3)}
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "root"))) as ckpt:
        ckpt.save(state, step=3).wait()
        ckpt_path = ckpt.list()[-1].path
    torch.save(state, tmp_path / "state.pt")
    prelude = PRELUDE.format(work=str(tmp_path), ckpt=ckpt_path, state=str(tmp_path / "state.pt"))
    by_expr: dict[str, dict[str, str]] = {}
    for call in documented_calls():
        expr, names = executable(call)
        if expr in by_expr:  # the same call written twice runs once; a failure names every place
            by_expr[expr]["id"] += f"\n{call.doc}:{call.line}"
            continue
        by_expr[expr] = {"id": call.id, "setup": prelude + setup_for(call, names), "call": expr,
                         "check": CHECKS.get(call.dotted, ""), "teardown": _TEARDOWN}
    todo = list(by_expr.values())
    (tmp_path / "calls.json").write_text(json.dumps(todo))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.doc_calls_child", str(tmp_path / "calls.json"),
                           str(tmp_path / "results.json")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    failed = [f"{name}\n{outcome}" for name, outcome in results.items() if outcome != "ok"]
    assert failed == [], "documented calls that fail as written:\n\n" + "\n\n".join(failed)
    assert len(results) == len(todo)


def test_every_dotted_name_the_prose_gives_resolves() -> None:
    missing = []
    for path in DOCS:
        text = prose(path)
        for match in _DOTTED.finditer(text):
            dotted = match.group(1)
            if dotted.rsplit(".", 1)[-1] in _FILE_SUFFIXES or dotted in NOT_PYTHON:
                continue
            try:
                resolve(dotted, callable_=False)
            except (ImportError, AttributeError) as e:
                line = text.count("\n", 0, match.start()) + 1
                missing.append(f"{path.relative_to(REPO).as_posix()}:{line}: {dotted} ({e})")
    assert missing == [], "the docs name what does not exist:\n" + "\n".join(missing)
