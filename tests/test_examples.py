"""The examples as a user runs them: fresh processes, small sizes, the commands their docstrings print."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"{result.args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


# ----------------------------------------------------------------------------- plain_pytorch.py


def latest(root: Path) -> dict:
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
        return ckpt.load()


@pytest.mark.timeout(240)
def test_plain_resume_after_a_full_run_says_so_and_extends_with_more_steps(tmp_path: Path) -> None:
    example = [sys.executable, str(EXAMPLES / "plain_pytorch.py"), "--root", str(tmp_path / "ck"), "--every", "2"]
    ok(run([*example, "--steps", "4"], tmp_path))
    saved = latest(tmp_path / "ck")
    assert saved["step"] == 3

    again = ok(run([*example, "--steps", "4", "--resume"], tmp_path))  # was: UnboundLocalError: loss
    assert "nothing to train" in again and "--steps" in again
    assert torch.equal(latest(tmp_path / "ck")["model"]["0.weight"], saved["model"]["0.weight"])

    longer = ok(run([*example, "--steps", "6", "--resume"], tmp_path))
    assert "resumed from step 3" in longer and "trained to step 5" in longer
    assert latest(tmp_path / "ck")["step"] == 5


def help_entries(text: str) -> dict[str, str]:
    """Each option of an argparse ``--help`` and the words that describe it."""
    entries: dict[str, str] = {}
    current = None
    for line in text.split("options:", 1)[1].splitlines():
        match = re.match(r"^  (-[^ ]+(?: [A-Z_]+)?(?:, -[^ ]+(?: [A-Z_]+)?)*)(?:\s{2,}(.*))?$", line)
        if match:
            current = match.group(1).split(",")[-1].split()[0]
            entries[current] = match.group(2) or ""
        elif current is not None and line.startswith("    "):
            entries[current] += " " + line.strip()
    return entries


@pytest.mark.parametrize("script", ["plain_pytorch.py", "accelerate_train.py", "lightning_gpt.py", "local_s3.py"])
def test_every_argument_of_an_example_is_described_by_help(script, tmp_path: Path) -> None:
    """Issue 55, item 9: ``plain_pytorch.py --help`` listed --root, --steps... and said nothing of any. And it answers
    at once: before the example imports torch, Lightning or Accelerate (Lightning's import alone took 5 s)."""
    result = run([sys.executable, "-X", "importtime", str(EXAMPLES / script), "--help"], tmp_path, timeout=120)
    ok(result)
    entries = help_entries(result.stdout)
    assert len(entries) > 1, entries
    bare = sorted(option for option, words in entries.items() if option != "--help" and len(words.split()) < 2)
    assert not bare, f"{script} --help describes nothing for {bare}"
    imported = re.findall(r"^import time: .*\| +([\w.]+)$", result.stderr, re.M)
    assert "argparse" in imported, result.stderr[-2000:]  # -X importtime's lines are read
    heavy = [name for name in imported if name.split(".")[0] in ("torch", "lightning", "accelerate")]
    assert not heavy, f"{script} --help imported {heavy[:5]} first"


# ----------------------------------------------------------------------------- accelerate_train.py

ACCELERATE = EXAMPLES / "accelerate_train.py"


def docstring_command(marker: str) -> list[str]:
    """The command line under the docstring comment that contains ``marker``, ready for subprocess."""
    lines = ACCELERATE.read_text().split('"""')[1].splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line)
    line = next(line for line in lines[start + 1:] if line.strip() and not line.strip().startswith("#"))
    return shlex.split(line)


def as_subprocess(words: list[str]) -> tuple[list[str], dict[str, str]]:
    """Leading ``VAR=value`` words become the environment; the launcher runs from this interpreter."""
    env = {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    launchers = {"python": [sys.executable], "torchrun": [sys.executable, "-m", "torch.distributed.run"],
                 "accelerate": [sys.executable, "-m", "accelerate.commands.accelerate_cli"]}
    command = launchers[words[0]] + [str(REPO / w) if w.startswith("examples/") else w for w in words[1:]]
    return command, env


@pytest.mark.timeout(300)
def test_accelerate_docstring_two_process_command_starts_two_processes(tmp_path: Path) -> None:
    command, env = as_subprocess(docstring_command("two processes"))
    steps = command.index("--steps")
    command[steps + 1] = "6"  # the docstring's run, shorter
    output = ok(run(command + ["--save-every", "3"], tmp_path, env))
    reports = sorted(re.findall(r"process (\d+) of (\d+) wrote (\d+) bytes", output))
    assert [(r, n) for r, n, _ in reports] == [("0", "2"), ("1", "2")], output  # two processes ran
    assert int(reports[0][2]) > 0, output  # the main process wrote the checkpoints


@pytest.mark.timeout(240)
def test_accelerate_rerun_without_resume_refuses_before_training(tmp_path: Path) -> None:
    example = [sys.executable, str(ACCELERATE), "--project-dir", "p", "--steps", "4", "--save-every", "2"]
    ok(run(example, tmp_path))
    checkpoints = tmp_path / "p" / "checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())

    again = run(example, tmp_path)
    assert again.returncode != 0
    assert "already holds checkpoints" in again.stderr and "--resume" in again.stderr, again.stderr
    assert "ConfigError" not in again.stderr  # refused up front, not by the first save_state() after training
    assert "Traceback" not in again.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == before  # the earlier run's checkpoints untouched


# ----------------------------------------------------------------------------- local_s3.py


@pytest.mark.s3
@pytest.mark.timeout(240)
def test_local_s3_server_serves_the_command_and_a_checkpointer_through_its_exports(tmp_path: Path) -> None:
    """Issue 55, item 8: the documented command that starts a local S3 server. What it prints to export is all a
    client needs: the command lists, a Checkpointer saves and loads, with no storage options; SIGTERM stops it."""
    pytest.importorskip("s3fs")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in [k for k in env if k.startswith("AWS_")]:
        del env[name]
    server = subprocess.Popen([sys.executable, str(EXAMPLES / "local_s3.py"), "--dir", str(tmp_path / "data"),
                               "--bucket", "demo"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in server.stdout:  # blocks until the server has printed its exports (or died)
            lines.append(line)
            if line.strip().startswith("export "):
                break
        exports = dict(word.split("=", 1) for word in lines[-1].split()[1:])
        assert set(exports) == {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                "AWS_DEFAULT_REGION"}, lines
        client = {**env, **exports, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}
        code = ("import torch\nfrom fastckpt import CheckpointConfig, Checkpointer\n"
                "with Checkpointer(CheckpointConfig(root='s3://demo/run')) as c:\n"
                "    c.save({'w': torch.arange(5.0)}, step=3).wait()\n"
                "    assert torch.equal(c.load()['w'], torch.arange(5.0))\n")
        ok(run([sys.executable, "-c", code], tmp_path, client))
        listed = ok(run([sys.executable, "-m", "fastckpt", "list", "s3://demo/run", "--json"], tmp_path, client))
        assert '"step": 3' in listed and '"where": "s3"' in listed, listed
    finally:
        server.terminate()  # SIGTERM: the script stops the server as Ctrl+C does
        rest = server.communicate(timeout=60)[0]
    assert server.returncode == 0 and "S3 server stopped." in rest, rest


# ----------------------------------------------------------------------------- lightning_gpt.py (the Quickstart demo)


SMALL = ["--width", "64", "--layers", "2", "--batch-size", "2"]  # the demo's model, small: seconds, not minutes
NUMBER = r"-?\d+"
FIGURE = rf"(?:{NUMBER} ± (?:\d+|\?)|-)"  # median ± noise, or "-"


@pytest.mark.timeout(400)
def test_demo_reports_the_loop_cost_and_resume_extends_the_run(tmp_path: Path) -> None:
    """Issue 55, item 1: a line per window while it trains; per plugin the loop time blocked, the CPU time and the
    wall-clock time of a checkpoint with their noise; a verdict from the first two; --resume keeps the first picture."""
    pytest.importorskip("lightning")
    pytest.importorskip("matplotlib")
    demo = [sys.executable, str(EXAMPLES / "lightning_gpt.py"), "--root", str(tmp_path / "ck"), "--every", "1"]
    # windows of one step: a warm-up, then clean / fastckpt / clean / AsyncCheckpointIO x3, clean
    first = ok(run([*demo, *SMALL, "--steps", "14"], tmp_path))
    assert re.search(r"^GPT of \d+\.\dM parameters \(width 64, 2 layers\): a checkpoint of about \d+ MB", first, re.M)
    progress = re.findall(r"^window +(\d+)/14 +(\S+) +steps +(\d+)-(\d+) +wall +\d+\.\d\d s +CPU +\d+\.\d\d s"
                          r"( +blocked +\d+\.\d ms)? +loss \d+\.\d+$", first, re.M)
    assert [int(p[0]) for p in progress] == list(range(1, 15)), first  # every window, in order, as it ended
    assert [p[1] for p in progress[:5]] == ["warm-up", "clean", "fastckpt", "clean", "AsyncCheckpointIO"], first
    assert [(int(p[2]), int(p[3])) for p in progress] == [(i, i) for i in range(14)], first
    assert all(bool(p[4]) == (p[1] != "clean") for p in progress), first  # a checkpoint's window says what it blocked
    assert first.index("window  14/14") < first.index("what a checkpoint cost")
    assert "14 windows of 1 steps, a warm-up then clean / fastckpt / clean / AsyncCheckpointIO" in first, first
    # both plugins measured in the same run, three windows each, every figure with its noise
    row = rf" +({FIGURE}) +(\d+) +({FIGURE}) +({FIGURE}) +3 +\d+\.\d$"
    fast = re.search(r"^fastckpt" + row, first, re.M)
    slow = re.search(r"^AsyncCheckpointIO" + row, first, re.M)
    assert fast and slow, first
    assert all("?" not in figure and figure != "-" for figure in (*fast.groups(), *slow.groups())), first
    verdicts = re.findall(r"^verdict: (.*)$", first, re.M)
    assert len(verdicts) == 1, first
    found = (rf"(?:blocked the training loop|took) \d+ ± \d+ (?:CPU )?ms less per checkpoint "
             rf"\({NUMBER} vs {NUMBER}(?:, \d+\.\dx)?\)")
    noise = (rf"the (?:loop time blocked|CPU time) per checkpoint within the noise "
             rf"\(fastckpt {FIGURE}, AsyncCheckpointIO {FIGURE} ms\)")
    assert re.fullmatch(rf"(?:fastckpt|AsyncCheckpointIO) is cheaper: it {found}(?: and {found}|; {noise})"
                        rf"|neither is cheaper on both counts: .*"
                        rf"|inconclusive: {noise} and {noise}; train longer \(--steps\)", verdicts[0]), verdicts[0]
    assert re.search(r"^wall clock: (inconclusive|fastckpt is cheaper|AsyncCheckpointIO is cheaper)", first, re.M), \
        first
    # fastckpt's own figures: one save per fastckpt window (warm-up included), each with last.ckpt, and the
    # run's final save (for --resume), outside the windows
    assert re.search(r"^5 checkpoints, .* mean stall", first, re.M), first
    assert re.search(r"^5 last.ckpt saves, ", first, re.M), first
    png = tmp_path / "ck" / "timeline.png"
    picture = png.read_bytes()
    assert picture[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".async-ckpt-*"))  # AsyncCheckpointIO's files went beside --root, and are gone

    # no --width/--layers: the model's size comes from the checkpoint
    again = ok(run([*demo, "--steps", "2", "--resume", "--no-compare"], tmp_path))
    assert "resuming from step 14" in again and "training to step 16" in again, again
    assert re.search(r"^window +2/2 +clean +steps +15-15 ", again, re.M), again
    rows = re.findall(r"^\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\S+)$", again, re.M)
    assert ("16", str(tmp_path / "ck" / "last.ckpt")) in rows, again  # it trained: a checkpoint at step 16
    assert "AsyncCheckpointIO" not in again
    # two windows (warm-up, clean): no fastckpt window between clean ones, and the verdict says so
    assert "verdict: inconclusive: 0 checkpointed windows between clean ones" in again, again
    resumed = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 16
    assert png.read_bytes() == picture  # the first run's picture stays; the resumed run's is beside it
    assert (tmp_path / "ck" / "timeline-from-step-14.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def demo_module():
    """examples/lightning_gpt.py as a module (it imports Lightning)."""
    pytest.importorskip("lightning")
    spec = importlib.util.spec_from_file_location("lightning_gpt_demo", EXAMPLES / "lightning_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def window_cost(name: str, values: list[float]):
    from fastckpt.timeline import WindowCost, median_and_noise

    median, se = median_and_noise(values)
    return WindowCost(name, tuple(values), median, 2 * se, 100.0)


FAST_BLOCKED = [30.0, 31.0, 29.0, 30.0, 32.0]
SLOW_BLOCKED = [300.0, 310.0, 290.0, 305.0, 295.0]


@pytest.mark.parametrize("cpu, said", [
    (([400.0, 410.0, 390.0, 405.0, 395.0], [1400.0, 1420.0, 1380.0, 1410.0, 1390.0]),
     r"fastckpt is cheaper: it blocked the training loop 270 ± \d+ ms less per checkpoint \(30 vs 300, 10\.0x\) and "
     r"took 1000 ± \d+ CPU ms less per checkpoint \(400 vs 1400, 3\.5x\)"),
    (([400.0, 900.0, 100.0, 700.0, 300.0], [500.0, 200.0, 800.0, 450.0, 600.0]),
     r"fastckpt is cheaper: it blocked the training loop 270 ± \d+ ms less per checkpoint \(30 vs 300, 10\.0x\); the "
     r"CPU time per checkpoint within the noise \(fastckpt 400 ± \d+, AsyncCheckpointIO 500 ± \d+ ms\)"),
    (([1400.0, 1420.0, 1380.0, 1410.0, 1390.0], [400.0, 410.0, 390.0, 405.0, 395.0]),
     r"neither is cheaper on both counts: fastckpt blocked the training loop 270 ± \d+ ms less per checkpoint "
     r"\(30 vs 300, 10\.0x\); AsyncCheckpointIO took 1000 ± \d+ CPU ms less per checkpoint \(400 vs 1400, 3\.5x\)"),
])
def test_demo_verdict_comes_from_the_blocked_and_cpu_figures(cpu, said) -> None:
    """Issue 55, item 1: the verdict names the cheaper plugin and by how much from the figures load hardly moves,
    says when one of them is within the noise, and when they disagree; the wall-clock figures take no part."""
    demo = demo_module()
    wall = [window_cost(name, [5000.0, -3000.0, 9000.0]) for name in (demo.FAST, demo.ASYNC)]  # all noise
    costs = demo.Costs([window_cost(demo.FAST, FAST_BLOCKED), window_cost(demo.ASYNC, SLOW_BLOCKED)],
                       [window_cost(demo.FAST, cpu[0]), window_cost(demo.ASYNC, cpu[1])], wall)
    assert re.fullmatch(said, demo.stable_verdict(costs)), demo.stable_verdict(costs)


def test_demo_verdict_is_inconclusive_when_the_noise_covers_both_figures() -> None:
    demo = demo_module()
    spread = [window_cost(name, [10.0, 400.0, 200.0, 900.0, 50.0]) for name in (demo.FAST, demo.ASYNC)]
    said = demo.stable_verdict(demo.Costs(spread, spread, spread))
    assert said.startswith("inconclusive: the loop time blocked per checkpoint within the noise (fastckpt 200 ± "), \
        said
    assert "and the CPU time per checkpoint within the noise" in said and said.endswith("train longer (--steps)")
    few = [window_cost(name, [10.0, 20.0]) for name in (demo.FAST, demo.ASYNC)]
    assert demo.stable_verdict(demo.Costs(few, few, few)).startswith("inconclusive: 2 checkpointed windows per plugin")


def test_demo_cpu_time_counts_a_running_child_process() -> None:
    """The CPU figure counts a persister process's work (persist.process): a child still running is counted, not
    only this process's threads."""
    demo = demo_module()
    burn = ("import sys, time\nwhile time.process_time() < 0.5:\n    pass\n"
            "print('burnt', flush=True)\nsys.stdin.read()\n")
    before, mine = demo.cpu_seconds(), time.process_time()
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "burnt\n"  # it has taken half a CPU second and waits, alive
        counted, mine = demo.cpu_seconds() - before, time.process_time() - mine
    finally:
        child.communicate("")
    # /proc counts a child's CPU time in clock ticks (10 ms): the half second read back may lack a few of them
    assert mine < 0.2 and counted >= 0.45, (mine, counted)
