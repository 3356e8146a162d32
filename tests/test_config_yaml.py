"""Hostile YAML configs are refused quickly with a ``ConfigError`` naming the source (issue 22, items 12 and 13).

Every reader of a config (``CheckpointConfig.from_yaml``, ``config_mapping``: Lightning's ``FastCheckpointIO(path)``
and Accelerate's ``enable``, the command's ``--config`` and ``--storage-option``) is tried on each file in one child
process under ``RLIMIT_AS`` with a per-case alarm: an alias bomb that expands, a FIFO that blocks or ``/dev/zero``
that reads forever fails its case (or the child) instead of hanging or exhausting the machine.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fastckpt import CheckpointConfig, ConfigError
from fastckpt.yamlfile import MAX_YAML_BYTES, MAX_YAML_NODES

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 300  # lightning's import alone takes seconds on a loaded machine; each case has its own alarm
CASE_ALARM_S = 20
AS_LIMIT = 3 << 30  # importing torch and lightning fits; a 9^9-leaf expansion does not

BOMB_LEVELS = 9


def _bomb(levels: int = BOMB_LEVELS) -> str:
    """A "billion laughs": 9 anchors, each a list of 9 aliases of the previous one (9^9 leaves expanded)."""
    lines = ['  a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return "root: /tmp/unused\nstorage_options:\n" + "\n".join(lines) + "\n"


def _plant(d: Path) -> dict[str, str]:
    """The hostile files, by case name."""
    files = {
        "bomb": _bomb(),
        "bomb_merge": "root: /tmp/unused\nstorage_options:\n  base: &b {" + ", ".join(f"k{i}: v" for i in range(9))
                      + "}\n" + "".join(f"  l{i}: &l{i} [{', '.join(['*b' if i == 0 else f'*l{i - 1}'] * 9)}]\n"
                                        for i in range(8)),
        "recursive": "root: /tmp/unused\nstorage_options: &a {self: *a}\n",
        "deep": "root: /tmp/unused\nstorage_options: " + "[" * 5000 + "]" * 5000 + "\n",
        "junk": b"\xff\xfe\x00\x01garbage\x80\x81\xc3\x28 not text".decode("latin-1"),  # written as bytes below
        "nul": "root: /tmp/unused\n\x00\x01\x02\n",
        "many_values": "root: /tmp/unused\nstorage_options: {" + ", ".join(f"k{i}: {i}" for i in range(MAX_YAML_NODES))
                       + "}\n",
    }
    paths = {}
    for name, text in files.items():
        p = d / f"{name}.yaml"
        p.write_bytes(text.encode("latin-1") if name == "junk" else text.encode())
        paths[name] = str(p)
    big = d / "big.yaml"  # a real, valid YAML file past the bound: once parsed for seconds
    line = "  k{:08d}: some value to make the line longer than usual\n"
    with big.open("w") as f:
        f.write("root: /tmp/unused\nstorage_options:\n")
        n = MAX_YAML_BYTES // len(line.format(0)) + 1000
        f.write("".join(line.format(i) for i in range(n)))
    paths["big"] = str(big)
    huge = d / "huge.yaml"  # 100 MB, sparse: refused by its size before a byte is read
    with huge.open("wb") as f:
        f.write(b"root: /tmp/unused\n# ")
        f.truncate(100 << 20)
    paths["huge"] = str(huge)
    fifo = d / "fifo.yaml"
    os.mkfifo(fifo)
    paths["fifo"] = str(fifo)
    zero = d / "zero.yaml"
    zero.symlink_to("/dev/zero")
    paths["zero"] = str(zero)
    folder = d / "folder.yaml"
    folder.mkdir()
    paths["folder"] = str(folder)
    return paths


# Run in the child: each reader on each file, with an alarm per case; prints one JSON line.
CHILD = textwrap.dedent("""
    import json, resource, signal, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    paths = json.loads(sys.argv[1])
    bomb_flow = sys.argv[2]
    from fastckpt import CheckpointConfig
    from fastckpt.config import config_mapping
    from fastckpt.cli.options import load_options, parse_pair
    from fastckpt_lightning import FastCheckpointIO

    class Alarm(BaseException):
        pass

    def on_alarm(signum, frame):
        raise Alarm()

    signal.signal(signal.SIGALRM, on_alarm)
    readers = {{
        "from_yaml": CheckpointConfig.from_yaml,
        "config_mapping": config_mapping,
        "lightning": FastCheckpointIO,
        "cli_config": lambda p: load_options(p, None, [], None),
    }}
    out = {{}}

    def attempt(key, fn):
        t0 = time.perf_counter()
        signal.alarm({alarm})
        try:
            fn()
            out[key] = ["accepted", "", time.perf_counter() - t0]
        except Alarm:
            out[key] = ["hung", "", time.perf_counter() - t0]
        except MemoryError:
            out[key] = ["MemoryError", "", time.perf_counter() - t0]
        except BaseException as e:
            out[key] = [type(e).__name__, str(e)[:400], time.perf_counter() - t0]
        finally:
            signal.alarm(0)

    for case, path in paths.items():
        for reader, fn in readers.items():
            attempt(case + "/" + reader, lambda: fn(path))
    attempt("bomb/storage_option", lambda: parse_pair("x=" + bomb_flow))
    print(json.dumps(out))
""")

CASES = ["bomb", "bomb_merge", "recursive", "deep", "junk", "nul", "many_values", "big", "huge", "fifo", "zero",
         "folder"]
READERS = ["from_yaml", "config_mapping", "lightning", "cli_config"]
SAYS = {"bomb": f"more than {MAX_YAML_NODES} values", "bomb_merge": f"more than {MAX_YAML_NODES} values",
        "recursive": "recursive", "deep": "nests deeper", "junk": "not UTF-8", "nul": "not valid YAML",
        "many_values": f"more than {MAX_YAML_NODES} values", "big": f"more than the {MAX_YAML_BYTES}",
        "huge": f"more than the {MAX_YAML_BYTES}", "fifo": "a FIFO", "zero": "a character device",
        "folder": "a directory"}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Any]:
    paths = _plant(tmp_path_factory.mktemp("hostile-yaml"))
    levels = [f"&a0 [{', '.join(['lol'] * 9)}]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 9)}]"
                                                    for i in range(1, BOMB_LEVELS)]
    bomb_flow = "[" + ", ".join(levels) + "]"  # the same bomb, in one flow-style value

    def limit() -> None:
        os.setsid()  # its own group: a timeout kills every process it started

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = CHILD.format(limit=AS_LIMIT, alarm=CASE_ALARM_S)
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(paths), bomb_flow], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, preexec_fn=limit)
    assert proc.returncode == 0, f"the child died ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", CASES)
def test_hostile_yaml_is_refused_quickly_naming_the_file(outcomes, case, reader) -> None:
    kind, message, seconds = outcomes[f"{case}/{reader}"]
    assert kind == "ConfigError", f"{case} via {reader}: {kind} {message}"
    assert SAYS[case] in message, message
    assert f"{case}.yaml" in message, f"the error does not name the file: {message}"
    assert seconds < CASE_ALARM_S / 2, f"{case} via {reader} took {seconds:.1f}s"


def test_alias_bomb_on_the_command_line_is_refused(outcomes) -> None:
    kind, message, _ = outcomes["bomb/storage_option"]
    assert kind == "ConfigError" and "--storage-option 'x'" in message and "values" in message, (kind, message)


def test_ordinary_yaml_with_aliases_still_loads(tmp_path) -> None:
    """Aliases are fine within the bound: a shared options block used twice."""
    p = tmp_path / "ok.yaml"
    p.write_text("\ufeffroot: /data/run\nstorage_options: &opts {anon: false, client_kwargs: {region_name: x}}\n"
                 "remote: {url: 's3://b/r', storage_options: *opts}\n")
    cfg = CheckpointConfig.from_yaml(p)
    assert cfg.storage_options == cfg.remote.storage_options == {"anon": False, "client_kwargs": {"region_name": "x"}}
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="'root' is required"):
        CheckpointConfig.from_yaml(empty)
    link = tmp_path / "link.yaml"  # a symlink to a regular file is read: the path is the user's choice
    link.symlink_to(p)
    assert CheckpointConfig.from_yaml(link) == cfg


# ---- mistakes in an ordinary file (issue 55, item 9) ---------------------------------------------------------


def test_a_key_typo_suggests_the_field_meant(tmp_path) -> None:
    """The error listed the allowed keys but guessed none; a close one is named, top level and in a section."""
    path = tmp_path / "fastckpt.yaml"
    path.write_text("root: ckpts\nretention: {keep_lsat: 3}\n")
    with pytest.raises(ConfigError, match=r"\['retention.keep_lsat'\] \(did you mean 'retention.keep_last'\?\); "
                                          r"allowed: \["):
        CheckpointConfig.from_yaml(path)
    path.write_text("root: ckpts\nretentoin: {keep_last: 3}\n")
    with pytest.raises(ConfigError, match=r"\['retentoin'\] \(did you mean 'retention'\?\)"):
        CheckpointConfig.from_yaml(path)
    path.write_text("root: ckpts\nstaging: {zzz: 1}\n")  # nothing close: no guess, the allowed keys still listed
    with pytest.raises(ConfigError) as ei:
        CheckpointConfig.from_yaml(path)
    assert "did you mean" not in str(ei.value) and "allowed: ['compiled_pass', 'crc_in_copy'" in str(ei.value)


@pytest.mark.parametrize("text, says", [("root: ckpts\nstaging: {mdoe: lazy}\n", "did you mean 'staging.mode'"),
                                        ("root: ckpts\nstaging: {mode: bogus}\n", "staging.mode must be one of")])
def test_the_integrations_name_the_file_of_a_refused_setting(tmp_path, text, says) -> None:
    """``FastCheckpointIO("x.yaml")`` and ``enable(acc, "x.yaml")`` dropped the file's name from the error."""
    from accelerate import Accelerator

    import fastckpt_accelerate
    from fastckpt_lightning import FastCheckpointIO
    from tests.accelerate_testing import reset_accelerate

    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{path}: .*{says}"):
        FastCheckpointIO(str(path))
    try:
        with pytest.raises(ConfigError, match=f"^{path}: .*{says}"):
            fastckpt_accelerate.enable(Accelerator(cpu=True), path)
    finally:
        reset_accelerate()
