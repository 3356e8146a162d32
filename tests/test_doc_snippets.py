"""Every ```python block of README.md and docs/*.md runs as written (issue 23, item 11).

Each block runs alone, in a fresh interpreter whose cwd is an empty tmp dir, so a reader can copy it and run it,
and must run without a warning from fastckpt (``snippet_runner.py``: a ``warnings.warn`` by fastckpt's code or a
record of WARNING or above on its loggers fails the block; issue 55, item 4).
A block may carry one directive, an HTML comment on the line right before its fence (invisible when rendered):

- ``<!-- snippet: file=NAME -->`` on a non-python block (the YAML config): its text is written to ``NAME`` in
  the cwd of every block of the same document, because the prose tells the reader to save it there
  (``fastckpt.yaml``).
- ``<!-- snippet: s3 -->`` on a python block that uses ``s3://bucket/...``: it runs against the suite's SeaweedFS
  server, reached the way any boto client is, through the standard ``AWS_*`` environment variables.
- ``<!-- snippet: skip: WHY -->`` on a python block that cannot run alone (it needs several ranks): it is
  still compiled and its imports resolved, and such blocks must stay rare (``MAX_SKIPPED``).
- ``<!-- snippet: warns: TEXT -->`` on a python block whose run makes fastckpt say something the doc explains next
  to it (the preemption demo's notices): what fastckpt says there must contain ``TEXT``; anything else it says
  still fails the block. Such blocks must stay rare (``MAX_WARNING``).

Blocks that are not Python (shell commands, YAML, output, signatures) are fenced with their own language.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().parent / "snippet_runner.py"
SAID_SOMETHING = 3  # snippet_runner's exit status when fastckpt warned
EXPECTED_ENV = "FASTCKPT_SNIPPET_WARNS"  # snippet_runner: what fastckpt may say in this block (its warns: directive)
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MAX_SKIPPED = 3       # multi-rank blocks; more skips would mean the docs stopped being tested
MAX_WARNING = 1       # blocks fastckpt may say something in (explained in the doc): the preemption demo
# One block: a tiny model trains for a few steps (seconds); a hang guard, not a budget: a hang fails instead of
# stalling the suite, a block slowed down by a loaded host never does.
BLOCK_TIMEOUT_S = 300
S3_BUCKET = "bucket"  # the bucket the docs name in their s3:// URLs

_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    doc: str          # path relative to the repo
    line: int         # 1-based line of the opening fence
    lang: str
    text: str
    directive: str    # "" when none

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def parse_blocks(path: Path, root: Path = REPO) -> list[Block]:
    """The fenced blocks of one markdown file, with the directive on the line before each fence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = path.relative_to(root).as_posix()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"{rel}:{i + 1}: a fenced block that never closes")
        directive = _DIRECTIVE.match(lines[i - 1]) if i else None
        blocks.append(Block(rel, i + 1, opening.group(1).lower(), "\n".join(lines[i + 1:end]) + "\n",
                            directive.group(1) if directive else ""))
        i = end + 1
    return blocks


def check_directive(block: Block) -> None:
    """Only the three directives exist; a typo must fail, never silently skip or run without its setup."""
    d = block.directive
    if not d:
        return
    if block.lang == "python":
        ok = d == "s3" or any(d.startswith(k) and d[len(k):].strip() for k in ("skip:", "warns:"))
    else:
        ok = re.fullmatch(r"file=[\w.-]+", d) is not None
    assert ok, f"{block.id}: unknown snippet directive {d!r} on a {block.lang or 'plain'} block"


ALL_BLOCKS = [b for doc in DOCS for b in parse_blocks(doc)]
PYTHON = [b for b in ALL_BLOCKS if b.lang == "python"]
RUNNABLE = [b for b in PYTHON if not b.directive.startswith("skip:")]
SKIPPED = [b for b in PYTHON if b.directive.startswith("skip:")]


def shared_files(doc: str | None = None) -> dict[str, str]:
    """Files a document shows and tells the reader to create (``file=NAME`` blocks); one content per name.
    With no ``doc``, checks every document's directives."""
    files: dict[str, tuple[str, str]] = {}
    for block in ALL_BLOCKS:
        check_directive(block)
        if block.directive.startswith("file=") and (doc is None or block.doc == doc):
            name = block.directive[len("file="):]
            if name in files and files[name][1] != block.text:
                raise AssertionError(f"{block.id}: {name} is shown differently at {files[name][0]}")
            files[name] = (block.id, block.text)
    return {name: text for name, (_, text) in files.items()}


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # no real credentials, ever
    env.update({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})
    return env


def s3_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The standard variables botocore reads, pointing at the suite's server, with the docs' bucket created."""
    from tests.s3server import ACCESS_KEY, SECRET_KEY

    server = request.getfixturevalue("s3_server")
    import s3fs

    fs = s3fs.S3FileSystem(**server.storage_options)
    if not fs.exists(S3_BUCKET):
        fs.mkdir(S3_BUCKET)
    return {"AWS_ENDPOINT_URL": server.endpoint_url, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1"}


def test_the_docs_have_python_blocks_and_directives_are_known() -> None:
    assert len(RUNNABLE) >= 9, [b.id for b in PYTHON]
    for doc in DOCS:  # checks every directive, and that a document shows each file one way only
        shared_files(doc.relative_to(REPO).as_posix())
    assert len(SKIPPED) <= MAX_SKIPPED, f"too many skipped blocks: {[b.id for b in SKIPPED]}"
    warning = [b.id for b in PYTHON if b.directive.startswith("warns:")]
    assert len(warning) <= MAX_WARNING, f"too many blocks fastckpt warns in: {warning}"
    # Python hidden in an unlabelled or mislabelled fence would escape this test.
    for block in ALL_BLOCKS:
        if block.lang != "python":
            assert not re.search(r"^\s*(from fastckpt|import fastckpt)", block.text, re.M), \
                f"{block.id}: Python code fenced as {block.lang or 'plain'}: fence it ```python"


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 30)
@pytest.mark.parametrize("code, status", [
    # fastckpt's warnings.warn, attributed to the user's line by stacklevel: still fastckpt's
    ("from fastckpt_lightning import FastCheckpointIO\nFastCheckpointIO(retention={'keep_last': 2})\n", 3),
    # fastckpt's logger at WARNING
    ("import logging\nlogging.getLogger('fastckpt').warning('fastckpt: persistence is falling behind')\n", 3),
    # another library's warning, and fastckpt's INFO: the reader's environment, not the doc's
    ("import warnings, logging\nwarnings.warn('a tip', UserWarning)\nlogging.getLogger('fastckpt').info('x')\n", 0),
    # a failure stays a failure
    ("raise SystemExit(1)\n", 1),
], ids=["warn", "log", "others", "fails"])
def test_the_runner_fails_a_block_fastckpt_warns_in(tmp_path: Path, code: str, status: int) -> None:
    (tmp_path / "snippet.py").write_text(code)
    result = subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "snippet.py")], cwd=tmp_path,
                            env=child_env({}), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == status, result.stderr
    if status == SAID_SOMETHING:
        assert "fastckpt warned while this documented block ran" in result.stderr


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 30)
def test_a_warns_directive_allows_only_what_the_doc_explains(tmp_path: Path) -> None:
    script = tmp_path / "snippet.py"
    script.write_text("import logging\nlog = logging.getLogger('fastckpt')\n"
                      "log.warning('fastckpt: preemption (SIGUSR1): final checkpoint')\n")
    run = lambda: subprocess.run([sys.executable, str(RUNNER), str(script)], cwd=tmp_path,  # noqa: E731
                                 env=child_env({EXPECTED_ENV: "fastckpt: preemption (SIGUSR1)"}),
                                 capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert run().returncode == 0
    script.write_text(script.read_text() + "log.warning('fastckpt: persistence is falling behind')\n")
    result = run()
    assert result.returncode == SAID_SOMETHING and "falling behind" in result.stderr.split("documented block ran")[1]


def test_a_mistyped_directive_fails(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("<!-- snippet: skipp: typo -->\n```python\nraise SystemExit(1)\n```\n")
    (block,) = parse_blocks(doc, root=tmp_path)
    with pytest.raises(AssertionError, match="unknown snippet directive"):
        check_directive(block)


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 60)
@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.id)
def test_python_block_runs_as_written(block: Block, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    for name, text in shared_files(block.doc).items():
        (tmp_path / name).write_text(text)
    script = tmp_path / "snippet.py"
    script.write_text(block.text)
    extra = s3_env(request) if block.directive == "s3" else {}
    if block.directive.startswith("warns:"):
        extra[EXPECTED_ENV] = block.directive[len("warns:"):].strip()
    try:
        # tests/snippet_runner.py runs it as `python snippet.py` would, and exits 3 when fastckpt warned (issue 55,
        # item 4: a documented block runs without a warning from fastckpt)
        result = subprocess.run([sys.executable, str(RUNNER), str(script)], cwd=tmp_path, env=child_env(extra),
                                capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.id}: still running after {BLOCK_TIMEOUT_S} s\n{e.stdout}\n{e.stderr}")
    what = "warns (fastckpt)" if result.returncode == SAID_SOMETHING else "fails"
    assert result.returncode == 0, f"{block.id} {what} as written:\n{block.text}\n---\n{result.stdout}\n{result.stderr}"


@pytest.mark.timeout(BLOCK_TIMEOUT_S + 30)
def test_skipped_blocks_compile_and_their_imports_resolve(tmp_path: Path) -> None:
    imports: list[str] = []
    for block in SKIPPED:
        tree = ast.parse(block.text, filename=block.id)  # a SyntaxError names the block
        imports += [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    if not imports:
        return
    script = tmp_path / "imports.py"
    script.write_text("\n".join(imports) + "\n")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=child_env({}),
                            capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, f"imports of skipped blocks fail:\n{script.read_text()}\n{result.stderr}"
