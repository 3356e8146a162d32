"""The fastckpt command on core roots, local and on the SeaweedFS S3 server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import yaml
from safetensors.torch import load as load_safetensors

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.cli import main
from fastckpt.storage.protocol import open_storage
from tests import shm_children as kids
from tests.cli_support import stage_then_hang, state
from tests.helpers import assert_bit_equal

REPO = Path(__file__).resolve().parents[1]


def pairs(options: dict[str, Any], prefix: str = "") -> list[str]:
    """fsspec options as repeated ``--storage-option key=value`` arguments (dotted keys nest)."""
    out: list[str] = []
    for k, v in options.items():
        if isinstance(v, dict):
            out += pairs(v, f"{prefix}{k}.")
        else:
            out += ["--storage-option", f"{prefix}{k}={v}"]
    return out


class Root:
    """A core root at ``url`` and the command-line options that reach it."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url, self.options, self.argv = url, options, pairs(options)

    def save(self, *steps: int) -> None:
        with Checkpointer(CheckpointConfig(root=self.url, storage_options=self.options,
                                           persist={"fsync": False})) as ckpt:
            for step in steps:
                ckpt.save(state(step), step=step).wait()

    def load(self, step: int) -> Any:
        with Checkpointer(CheckpointConfig(root=self.url, storage_options=self.options)) as ckpt:
            return ckpt.load(step=step)

    def put(self, rel: str, data: bytes) -> None:
        fs, path = fsspec.core.url_to_fs(f"{self.url}/{rel}", **self.options)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(path, data)

    def path(self, step: int) -> str:
        return f"{self.url}/step-{step:09d}"


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path) -> Root:
    if request.param == "local":
        return Root(str(tmp_path / "root"), {})
    s3 = request.getfixturevalue("s3_root")
    return Root(s3.url, s3.storage_options)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_list_json_rows_and_garbage(root, capsys) -> None:
    root.save(1, 2, 3)
    root.put("step-000000004/shard-00000.0123456789ab.safetensors", b"x" * 10)  # a save that died
    code, out, _ = run(["list", root.url, "--json", *root.argv], capsys)
    assert code == 0
    rows = json.loads(out)
    assert [(r["step"], r["status"]) for r in rows] == [(1, "committed"), (2, "committed"), (3, "committed"),
                                                         (4, "uncommitted")]
    assert {r["where"] for r in rows} == {"s3" if "://" in root.url else "local"}  # the root's own scheme
    assert all(r["created"] and r["nbytes"] > 0 for r in rows)
    code, out, _ = run([*root.argv, "list", root.url], capsys)  # options before the command work too
    assert code == 0 and out.splitlines()[0].split()[:3] == ["STEP", "EPOCH", "COMMITTED"]
    assert len(out.splitlines()) == 5


def test_missing_root_is_an_error(root, capsys) -> None:
    code, out, err = run(["list", root.url + "-missing", *root.argv], capsys)
    assert code == 1 and not out
    assert "no such file or folder" in err and root.url + "-missing" in err


def test_list_shows_where_each_checkpoint_lives(tmp_path, s3_root, capsys) -> None:
    local = str(tmp_path / "root")
    config = {"root": local, "remote": {"url": s3_root.url, "storage_options": s3_root.storage_options},
              "persist": {"fsync": False}}
    with Checkpointer(CheckpointConfig.from_dict(config)) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state(step), step=step).wait()
    # closed: every upload finished. Step 2 then vanishes from the remote tier, step 1 from the local root.
    fs, path = fsspec.core.url_to_fs(s3_root.url, **s3_root.storage_options)
    fs.rm(f"{path}/step-000000002", recursive=True)
    open_storage(local).delete_tree(os.path.join(local, "step-000000001"))
    cfg = tmp_path / "fastckpt.yaml"
    cfg.write_text(yaml.safe_dump(config))
    code, out, _ = run(["list", local, "--json", "--config", str(cfg)], capsys)
    assert code == 0
    assert [(r["step"], r["where"], r["status"]) for r in json.loads(out)] == [
        (1, "remote", "committed"), (2, "local", "pending upload"), (3, "both", "committed")]


def test_inspect_json(root, capsys) -> None:
    root.save(5)
    code, out, _ = run(["inspect", root.path(5), "--json", *root.argv], capsys)
    assert code == 0
    info = json.loads(out)
    rows = {t["key"]: t for t in info["tensors"]}
    assert rows["model/enc/w"] == {"key": "model/enc/w", "dtype": "float32", "shape": [8, 8], "nbytes": 256}
    assert rows["model/head.b"]["dtype"] == "bfloat16" and info["kind"] == "core"
    code, out, _ = run(["inspect", root.path(5) + "/manifest.json", "--json", *root.argv], capsys)
    assert code == 0 and json.loads(out) == info  # the manifest names its checkpoint


def test_verify_names_a_flipped_byte(root, capsys) -> None:
    root.save(1, 2)
    code, out, _ = run(["verify", root.path(1), root.path(2), *root.argv], capsys)
    assert code == 0 and out.count("OK") == 2
    fs, path = fsspec.core.url_to_fs(root.path(2), **root.options)
    [shard] = [p for p in fs.ls(path, detail=False) if "shard-" in p]
    data = bytearray(fs.cat_file(shard))
    data[-3] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    code, out, err = run(["verify", root.path(1), root.path(2), *root.argv], capsys)
    assert code == 1 and "OK" in out and root.path(1) in out
    bad = err.splitlines()
    assert bad and all(shard.rsplit("/", 1)[-1] in line for line in bad), err
    assert any("checksum mismatch" in line for line in bad)


def test_inspect_shows_the_step_and_the_optimizers_param_groups(root, capsys) -> None:
    """Issue 55, item 7: a core checkpoint's plain values (the step, an optimizer's ``param_groups``) were hidden:
    "0 other values", JSON ``objects: []``. Every value of the tree is a row now, and the header names the step."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.95))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with Checkpointer(CheckpointConfig(root=root.url, storage_options=root.options, staging={"mode": "eager"},
                                       persist={"fsync": False})) as ckpt:
        ckpt.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 7,
                   "dtype": torch.bfloat16}, step=7).wait()
    code, out, _ = run(["inspect", root.path(7), "--json", *root.argv], capsys)
    assert code == 0
    info = json.loads(out)
    values = {o["key"]: (o["type"], o["value"]) for o in info["objects"]}
    assert info["step"] == 7 and values["step"] == ("int", "7")
    assert values["optim/param_groups/0/lr"] == ("float", "0.0003")
    assert values["optim/param_groups/0/betas/1"] == ("float", "0.95")
    assert values["optim/param_groups/0/params/1"] == ("int", "1")
    assert values["dtype"] == ("dtype", "torch.bfloat16")  # a non-plain leaf, through the objects file
    assert {t["key"] for t in info["tensors"]} >= {"model/weight", "optim/state/0/exp_avg"}  # tensors unchanged
    assert not any(o["key"] in {t["key"] for t in info["tensors"]} for o in info["objects"])
    code, out, _ = run(["inspect", root.path(7), *root.argv], capsys)
    head = out.splitlines()[0]
    assert code == 0 and "(core, step 7, 8 tensors, " in head and f"{len(values)} other values)" in head
    assert any(line.split()[:3] == ["optim/param_groups/0/lr", "float", "0.0003"] for line in out.splitlines())


def test_verify_a_root_verifies_every_checkpoint_under_it(root, capsys) -> None:
    """Issue 55, item 7: ``verify ROOT`` was refused ("not a checkpoint"); it verifies each checkpoint under it,
    names a save that never committed (skipped), and fails on the one damaged checkpoint."""
    root.save(1, 2, 3)
    root.put("step-000000004/shard-00000.0123456789ab.safetensors", b"x" * 10)  # a save that died
    code, out, err = run(["verify", root.url, *root.argv], capsys)
    assert code == 0, err
    assert out.splitlines() == [f"OK  {root.path(s)}" for s in (1, 2, 3)]
    assert "skipped" in err and root.path(4) in err and "never committed" in err
    fs, path = fsspec.core.url_to_fs(root.path(2), **root.options)
    [shard] = [p for p in fs.ls(path, detail=False) if "shard-" in p]
    data = bytearray(fs.cat_file(shard))
    data[-3] ^= 0x01
    fs.pipe_file(shard, bytes(data))
    code, out, err = run(["verify", root.url, *root.argv], capsys)
    assert code == 1 and out.splitlines() == [f"OK  {root.path(s)}" for s in (1, 3)]
    assert "checksum mismatch" in err and shard.rsplit("/", 1)[-1] in err


def test_verify_a_folder_without_checkpoints_is_an_error(tmp_path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("hi")
    code, out, err = run(["verify", str(tmp_path / "empty")], capsys)
    assert code == 1 and not out
    assert "no checkpoint, and none under it" in err and str(tmp_path / "empty") in err


def test_export_torch_round_trip(root, tmp_path, capsys) -> None:
    root.save(3)
    out = f"{root.url}-export/step3.pt"
    code, _, _ = run(["export", root.path(3), out, "--to", "torch", *root.argv], capsys)
    assert code == 0
    with fsspec.open(out, "rb", **root.options) as f:
        exported = torch.load(f, weights_only=True)
    assert_bit_equal(exported, root.load(3))


def test_export_safetensors_sharded(root, capsys) -> None:
    root.save(3)
    out = f"{root.url}-hf"
    code, stdout, _ = run(["export", root.path(3), out, "--to", "safetensors", "--max-shard-size", "200B",
                           *root.argv], capsys)
    assert code == 0
    fs, path = fsspec.core.url_to_fs(out, **root.options)
    index = json.loads(fs.cat_file(f"{path}/model.safetensors.index.json"))
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        weights.update(load_safetensors(fs.cat_file(f"{path}/{name}")))
    model = root.load(3)["model"]
    assert_bit_equal(dict(sorted(weights.items())), {"enc.w": model["enc"]["w"], "head.b": model["head.b"]})
    assert index["metadata"]["total_size"] == 256 + 6


def test_export_safetensors_needs_a_key_without_model(tmp_path, capsys) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save({"net": {"w": torch.ones(2)}, "opt": {}}, step=1).wait()
    code, _, err = run(["export", str(tmp_path / "step-000000001"), str(tmp_path / "hf"), "--to", "safetensors"],
                       capsys)
    assert code == 1 and "no 'model' subtree" in err and "['net', 'opt']" in err and "--key" in err
    code, _, _ = run(["export", str(tmp_path / "step-000000001"), str(tmp_path / "w.safetensors"),
                      "--to", "safetensors", "--key", "net"], capsys)
    assert code == 0
    assert_bit_equal(load_safetensors((tmp_path / "w.safetensors").read_bytes()), {"w": torch.ones(2)})


def test_import_torch_save_file(root, tmp_path, capsys) -> None:
    src = tmp_path / "plain.pt"
    torch.save(state(7), src)
    code, out, _ = run(["import", str(src), root.url, "--step", "7", *root.argv], capsys)
    assert code == 0 and "step-000000007" in out
    assert_bit_equal(root.load(7), state(7))


def test_import_refuses_arbitrary_pickles(tmp_path, capsys) -> None:
    src = tmp_path / "evil.pt"
    torch.save({"obj": Path("/")}, src)  # a class the weights_only loader does not rebuild
    code, _, err = run(["import", str(src), str(tmp_path / "root"), "--step", "1"], capsys)
    assert code == 1 and "weights_only=True" in err and str(src) in err
    assert not (tmp_path / "root").exists()


def test_import_dcp_checkpoint(tmp_path, capsys) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state(4), checkpoint_id=str(tmp_path / "dcp"))  # single process, no process group
    code, _, _ = run(["import", str(tmp_path / "dcp"), str(tmp_path / "root"), "--step", "4"], capsys)
    assert code == 0
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "root"))) as ckpt:
        assert_bit_equal(ckpt.load(step=4), state(4))
    code, out, _ = run(["inspect", str(tmp_path / "dcp"), "--json"], capsys)
    assert code == 0 and {"key": "model.enc.w", "dtype": "float32", "shape": [8, 8], "nbytes": 256} in \
        json.loads(out)["tensors"]


def test_gc_retention_and_garbage(root, capsys) -> None:
    root.save(1, 2, 3, 4, 5)
    root.put("step-000000009/meta.0123456789ab.json",  # a save that died uncommitted (its meta names its uid)
             json.dumps({"tree": {"T": 0}, "tensors": [{"file": "shard-00000.0123456789ab.safetensors"}]}).encode())
    argv = ["gc", root.url, "--keep-last", "2", "--keep-every", "2", "--grace-s", "0", *root.argv]
    code, out, _ = run([*argv, "--dry-run"], capsys)
    assert code == 0 and "would remove" in out and "step-000000001" in out and "step-000000009" in out
    assert [r["step"] for r in _rows(root, capsys)] == [1, 2, 3, 4, 5, 9]
    code, out, _ = run(argv, capsys)
    assert code == 0 and out.count("removed") == 3
    assert [r["step"] for r in _rows(root, capsys)] == [2, 4, 5]
    assert_bit_equal(root.load(4), state(4))


def _rows(root: Root, capsys) -> list[dict[str, Any]]:
    code, out, _ = run(["list", root.url, "--json", *root.argv], capsys)
    assert code == 0
    return json.loads(out)


def test_gc_refuses_while_a_writer_holds_the_root(tmp_path, capsys) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(state(1), step=1).wait()
        code, _, err = run(["gc", str(tmp_path), "--keep-last", "1"], capsys)
        assert code == 1 and "lock" in err.lower()


def _disk(top: Path) -> dict[str, tuple]:
    """Everything on disk under ``top``, ``top`` included: kind, size, mtime, extended attributes, content digest."""
    import hashlib
    import stat

    out: dict[str, tuple] = {}
    for dirpath, dirs, files in os.walk(top):
        for p in [Path(dirpath)] + [Path(dirpath) / n for n in dirs + files]:
            st = p.lstat()
            attrs = {a: os.getxattr(p, a, follow_symlinks=False) for a in os.listxattr(p, follow_symlinks=False)}
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else None
            out[str(p)] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, st.st_ctime_ns, attrs, digest)
    return out


def test_gc_dry_run_changes_nothing_on_disk(tmp_path, capsys) -> None:
    # a core root with steps retention drops and a save that died; a Lightning dirpath with a dead save's temporary
    # file; a home directory holding only the user's own files: `--dry-run` reports and writes nothing, no lock
    core, lightning, home = tmp_path / "core", tmp_path / "lightning", tmp_path / "home"
    with Checkpointer(CheckpointConfig(root=str(core))) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(state(step), step=step).wait()
    os.remove(core / ".fastckpt.lock")  # as a root copied from elsewhere arrives: no lock file yet
    dead = core / "step-000000009"
    dead.mkdir()
    (dead / "meta.0123456789ab.json").write_text(  # its meta names its uid: fastckpt's, provably
        json.dumps({"tree": {"T": 0}, "tensors": [{"file": "shard-00000.0123456789ab.safetensors"}]}))
    with Checkpointer(CheckpointConfig(root=str(lightning))) as files:
        for step in (1, 2, 3):
            files.save_file({"w": torch.full((8,), float(step))}, f"epoch=0-step={step}.ckpt", step=step).wait()
    from fastckpt.storage.tempmark import mark_bytes, mark_name
    temp = lightning / ".epoch=0-step=4.ckpt.fastckpt-tmp-0123456789ab"
    temp.write_bytes(b"\0" * 100)
    Path(mark_name(str(temp))).write_bytes(mark_bytes(temp.name))
    home.mkdir()
    (home / ".bashrc").write_text("export A=1\n")
    (home / "notes.txt").write_text("mine")
    for entry in (*core.rglob("*"), *lightning.rglob("*"), core, lightning, *home.rglob("*"), home):
        os.utime(entry, (1, 1), follow_symlinks=False)  # long dead: everything gc may remove is reported
    before = _disk(tmp_path)
    for folder, expect in ((core, 3), (lightning, 4), (home, 0)):
        code, out, err = run(["gc", str(folder), "--keep-last", "1", "--grace-s", "60", "--dry-run"], capsys)
        assert code == 0, err
        assert out.count("would remove") == expect, out
        assert _disk(tmp_path) == before, f"gc --dry-run of {folder} changed the disk"
    assert not any(p.name == ".fastckpt.lock" for p in tmp_path.rglob("*"))
    code, out, _ = run(["gc", str(core), "--keep-last", "1", "--grace-s", "60"], capsys)  # the real one acts
    assert code == 0 and out.count("removed") == 3 and not dead.exists()


def test_persist_pending_commits_what_a_crashed_process_staged(tmp_path, capsys) -> None:
    root, shm = tmp_path / "ckpts", tmp_path / "shm"
    shm.mkdir()
    proc, conn = kids.start(kids.train, str(root), str(shm), 3, 2)  # writes from step 2 on hang
    try:
        assert [kids.receive(proc, conn) for _ in range(3)] == [1, 2, 3]
    finally:
        kids.kill(proc)  # SIGKILL: steps 2 and 3 live only in shared memory
    code, out, _ = run(["persist-pending", str(root), "--shm-dir", str(shm)], capsys)
    assert code == 0
    assert "(step 2)" in out and "(step 3)" in out
    with Checkpointer(CheckpointConfig(root=str(root))) as ck:
        assert kids.check_committed(ck, [2, 3])[-2:] == [2, 3]
    code, _, err = run(["persist-pending", str(root), "--shm-dir", str(shm)], capsys)
    assert code == 0 and "nothing staged" in err


def test_persist_pending_on_s3(s3_root, tmp_path, capsys) -> None:
    (tmp_path / "shm").mkdir()
    proc, conn = kids.start(stage_then_hang, s3_root.url, s3_root.storage_options, str(tmp_path / "shm"), 11)
    try:
        assert kids.receive(proc, conn) == 11  # staged; its upload hangs
    finally:
        kids.kill(proc)
    root = Root(s3_root.url, s3_root.storage_options)
    cfg = tmp_path / "fastckpt.yaml"  # shm_dir and the storage options from the YAML this time
    cfg.write_text(yaml.safe_dump({"staging": {"shm_dir": str(tmp_path / "shm")},
                                   "storage_options": s3_root.storage_options}))
    code, out, _ = run(["persist-pending", root.url, "--config", str(cfg)], capsys)
    assert code == 0 and f"{root.path(11)}  (step 11)" in out
    assert_bit_equal(root.load(11), state(11))


def test_storage_option_values_are_typed_and_config_is_validated(tmp_path, capsys) -> None:
    from fastckpt.cli.options import load_options

    opts = load_options(None, {"anon": False}, ["anon=true", "client_kwargs.region_name=eu-1", "retries=3"], None)
    assert opts.storage_options == {"anon": True, "client_kwargs": {"region_name": "eu-1"}, "retries": 3}
    bad = tmp_path / "bad.yaml"
    bad.write_text("persist: {workrs: 2}\n")
    code, _, err = run(["list", str(tmp_path), "--config", str(bad)], capsys)
    assert code == 1 and "persist.workrs" in err
    code, _, err = run(["list", str(tmp_path), "--storage-option", "novalue"], capsys)
    assert code == 1 and "key=value" in err


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_help_does_not_import_torch() -> None:
    code = ("import sys, contextlib, io\nfrom fastckpt.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: main(['--help'])\n    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'fastckpt --help imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), cwd=REPO, timeout=60)


def test_list_does_not_import_torch(tmp_path) -> None:
    """Issue 55, item 7: ``list`` imported torch (1.1 of its 1.7 s). A core root, a Lightning dirpath (``last.ckpt``
    names no step: its pickle is read) and Accelerate folders (their optimizer's step count) list without it."""
    core = tmp_path / "core"
    Root(str(core), {}).save(1, 2)
    lightning = tmp_path / "lightning"
    lightning.mkdir()
    torch.save({"global_step": 12, "epoch": 3, "state_dict": {"w": torch.randn(4)}}, lightning / "last.ckpt")
    folder = tmp_path / "accelerate" / "checkpoints" / "checkpoint_0"
    folder.mkdir(parents=True)
    torch.save({"state": {0: {"step": torch.tensor(9.0), "exp_avg": torch.randn(4)}}, "param_groups": [{"lr": 0.1}]},
               folder / "optimizer.bin")
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    torch.save({"step": 0}, folder / "random_states_0.pkl")
    code = ("import sys, json, contextlib, io\nfrom fastckpt.cli import main\nrows = []\n"
            "for root in sys.argv[1:]:\n"
            "    out = io.StringIO()\n"
            "    with contextlib.redirect_stdout(out):\n"
            "        assert main(['list', root, '--json']) == 0\n"
            "    rows += [(r['name'], r['step']) for r in json.loads(out.getvalue())]\n"
            "print(json.dumps([rows, 'torch' in sys.modules]))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(core), str(lightning), str(tmp_path / "accelerate")],
                          env=_env(), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows, imported = json.loads(proc.stdout)
    assert [tuple(r) for r in rows] == [("step-000000001", 1), ("step-000000002", 2), ("last.ckpt", 12),
                                         ("checkpoint_0", 9)]
    assert not imported, "fastckpt list imported torch"


def test_piped_into_head_ends_quietly(tmp_path) -> None:
    torch.save({f"t{i:05d}": torch.zeros(1) for i in range(4000)}, tmp_path / "many.pt")  # > a pipe buffer of rows
    proc = subprocess.run(f"{sys.executable} -m fastckpt inspect {tmp_path / 'many.pt'} | head -1; "
                          "exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash", capture_output=True,
                          text=True, env={**_env(), "PYTHONWARNINGS": "ignore"}, cwd=REPO, timeout=120)
    # Warnings are off: a third-party import warning (torch's about pynvml, where installed) is not the CLI's.
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout.startswith(str(tmp_path / "many.pt"))


def test_package_ships_py_typed() -> None:
    assert (REPO / "fastckpt" / "py.typed").is_file()
    setup = __import__("tomllib").loads((REPO / "pyproject.toml").read_text())
    assert "py.typed" in setup["tool"]["setuptools"]["package-data"]["fastckpt"]


def test_benchmark_harness_records_cli_help_s(tmp_path) -> None:
    from benchmarks import cli as bench_cli
    from benchmarks.run import QUICK_PLAN, run_all

    results = run_all(QUICK_PLAN, tmp_path, isolate=False, sections=("cli",), peer_names=[])
    figure = results["cli"]["result"]
    assert results["cli"]["ok"] and 0 < figure["cli_help_s"] <= figure["cli_help_median_s"]
    assert "`fastckpt --help` answers in" in "\n".join(bench_cli.markdown(results["cli"]))
