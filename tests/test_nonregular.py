"""A checkpoint is a regular file or a folder: nothing else is ever read (issue 22, item 8).

A ``.ckpt`` that is a symlink to ``/dev/zero`` made the old pointer reader read until memory ran out (its size
is 0, which the size check trusted); a FIFO blocked the open for ever. Every read opens with O_NONBLOCK, checks
the type with ``fstat`` before reading a byte, and reads no more than the size it saw. Each case runs in a child
process under RLIMIT_AS and a timeout: without the fix it hangs or runs out of memory.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.cli import main
from fastckpt.errors import IntegrityError
from tests.helpers import assert_bit_equal, run_child

_EACH = """
import sys
from {module} import {function} as read
for path in sys.argv[1:]:
    try:
        read(path)
    except Exception as e:
        print("|".join((path, type(e).__name__, str(e).replace("\\n", " "))))
    else:
        print(path + "|loaded|")
"""


def _read_each(module: str, function: str, paths: list[Path]) -> dict[str, tuple[str, str]]:
    """``function(path)`` for each path, in one child (RLIMIT_AS, timeout): path -> (error type, message)."""
    done = run_child(_EACH.format(module=module, function=function), *map(str, paths))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|", 2) for line in done.stdout.splitlines()]
    return {path: (kind, message) for path, kind, message in rows}


_VERIFY = """
import sys
from fastckpt.cli import main
print("exit", main(["verify", sys.argv[1]]))
"""


def _fifo(path: Path) -> Path:
    os.mkfifo(path, 0o600)  # nobody ever writes it: an open for reading would wait for ever
    return path


_SPECIAL = {
    "symlink to /dev/zero": (lambda p: p.symlink_to("/dev/zero"), "a character device"),
    "FIFO": (_fifo, "a FIFO"),
}


def test_a_lightning_ckpt_that_is_not_a_regular_file_is_refused(tmp_path) -> None:
    paths = {}
    for kind, (make, said) in _SPECIAL.items():
        paths[said] = tmp_path / f"epoch=0-step={len(paths)}.ckpt"
        make(paths[said])
    got = _read_each("fastckpt_lightning.reader", "read_checkpoint", list(paths.values()))
    for said, path in paths.items():
        kind, message = got[str(path)]
        assert kind == "IntegrityError" and said in message and "not a regular file" in message, (path, kind, message)


def test_find_last_checkpoint_skips_a_last_ckpt_that_is_not_a_regular_file(tmp_path) -> None:
    dirs = []
    for kind, (make, _) in _SPECIAL.items():
        d = tmp_path / kind.replace("/", "_").replace(" ", "_")
        d.mkdir()
        torch.save({"global_step": 3}, d / "last-v1.ckpt")
        make(d / "last.ckpt")
        dirs.append(d)
    code = ("import sys\nfrom fastckpt_lightning.model_checkpoint import find_last_checkpoint\n"
            "for d in sys.argv[1:]:\n    print('found', find_last_checkpoint(d))")
    done = run_child(code, *map(str, dirs))
    assert done.returncode == 0, done.stderr[-2000:]
    for d in dirs:
        assert f"found {d / 'last-v1.ckpt'}" in done.stdout, done.stdout
        assert f"{d / 'last.ckpt'}" in done.stderr  # warned of, by name
    assert done.stderr.count("not a regular file") >= 2


def test_a_ckpt_symlinked_to_a_regular_checkpoint_still_loads(tmp_path) -> None:
    """Lightning's ``save_last: link`` makes ``last.ckpt`` a symlink: following one to a regular file is fine."""
    from fastckpt_lightning.reader import read_checkpoint

    state = {"state_dict": {"w": torch.randn(64, 8)}, "global_step": 7}
    torch.save(state, tmp_path / "epoch=0-step=7.ckpt")
    (tmp_path / "last.ckpt").symlink_to(tmp_path / "epoch=0-step=7.ckpt")
    assert_bit_equal(state, read_checkpoint(str(tmp_path / "last.ckpt"), weights_only=True))


def _core(root: Path) -> Path:
    with Checkpointer(CheckpointConfig(root=str(root))) as ck:
        ck.save({"w": torch.arange(512, dtype=torch.float32)}, step=1).wait()
    return root / "step-000000001"


def test_a_core_checkpoint_file_that_is_not_a_regular_file_is_refused(tmp_path) -> None:
    cases = {}
    for which in ("manifest", "meta", "shard"):
        for kind, (make, said) in _SPECIAL.items():
            path = _core(tmp_path / f"{which}-{len(cases)}")
            manifest = json.loads((path / "manifest.json").read_text())
            name = {"manifest": "manifest.json", "meta": manifest["meta"],
                    "shard": next(n for n in manifest["files"] if n.startswith("shard-"))}[which]
            (path / name).unlink()
            make(path / name)
            cases[str(path)] = (path / name, said)
    got = _read_each("fastckpt", "load_checkpoint", [Path(p) for p in cases])
    for path, (bad, said) in cases.items():
        kind, message = got[path]
        assert kind in ("IntegrityError", "UnsafeCheckpointError") and str(bad) in message, (bad, kind, message)
        # the meta's size is checked against the manifest first; a symlinked shard is refused as leading outside
        assert said in message or "truncated or was replaced" in message or "lies outside" in message, message


def test_a_checkpointer_lists_past_a_manifest_that_is_a_fifo(tmp_path, caplog) -> None:
    root = tmp_path / "root"
    bad = _core(root)
    with Checkpointer(CheckpointConfig(root=str(root))) as ck:
        ck.save({"w": torch.ones(8)}, step=2).wait()
    (bad / "manifest.json").unlink()
    _fifo(bad / "manifest.json")
    code = ("import sys\nfrom fastckpt import CheckpointConfig, Checkpointer\n"
            "with Checkpointer(CheckpointConfig(root=sys.argv[1])) as ck:\n"
            "    print('steps', [c.step for c in ck.list()], ck.load()['w'].tolist())")
    done = run_child(code, str(root))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "steps [2] [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]" in done.stdout


def test_fastckpt_verify_refuses_a_fifo_ckpt(tmp_path) -> None:
    ckpt = _fifo(tmp_path / "model.ckpt")
    done = run_child(_VERIFY, str(ckpt))
    assert "exit 1" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert "not a regular file" in done.stderr and str(ckpt) in done.stderr


def test_read_bytes_stops_at_the_size_seen_at_open(tmp_path) -> None:
    """Bound every read by the file's size: bytes appended after the open are not read (nor any without end)."""
    from fastckpt.storage.local import LocalStorage, open_regular

    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    assert LocalStorage(str(tmp_path)).read_bytes(str(path)) == b"x" * 100
    with pytest.raises(IntegrityError, match="a character device"):
        open_regular("/dev/zero")
