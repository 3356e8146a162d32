"""Accelerate folders on ``s3://`` never re-send unchanged bytes (format/bundlededup.py): each ``save_state`` is a new
``checkpoint_N``, whose files copy their unchanged ranges server-side from ``checkpoint_{N-1}`` (the content records
listed in its ``manifest.json``), against the real SeaweedFS through a proxy that counts every byte the client sends.
The folder holds stock Accelerate's files and ``manifest.json`` only, stock ``load_state`` reads it bit-exact, and a
gone, replaced or lying source costs bytes, never a wrong file."""
from __future__ import annotations

import io
import json
import textwrap
from pathlib import Path

import pytest
import s3fs
import torch
from torch import nn

import fastckpt_accelerate
from accelerate_testing import fresh_accelerate, make_accelerator  # noqa: F401 (fixture)
from fastckpt.format.contenthash import FIELD
from fastckpt.storage.partplan import MIN_PART
from tests.helpers import run_child, s3_uploads
from tests.test_accelerate_s3_shared import _same
from tests.test_s3_dedup import counted  # noqa: F401 - a fixture: bytes the client sends through the proxy

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
LAYERS = 3  # each a frozen 8 MiB base and a trained 16 KiB adapter after it in the file: 3 changed regions
SLACK = 128 * 1024  # HTTP headers of every request (creates, copies, markers, completes)
STOCK = {"model.safetensors", "optimizer.bin", "random_states_0.pkl"}


class Lora(nn.Module):
    """LoRA's shape: frozen bases, small trained adapters; the names interleave them in ``model.safetensors``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        for i in range(LAYERS):
            base = nn.Linear(1024, 2048, bias=False)
            base.weight.requires_grad_(False)
            setattr(self, f"l{i}_base", base)
            setattr(self, f"l{i}_lora", nn.Linear(1024, 4, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(getattr(self, f"l{i}_lora")(x).sum() for i in range(LAYERS))


def _setup(tmp_path: Path, **kwargs):
    acc = make_accelerator(tmp_path, **kwargs)
    model = Lora()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt) -> None:
    acc.backward(model(torch.randn(8, 1024)).square())
    opt.step()
    opt.zero_grad()


def _fs(proxied) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(**proxied.server.storage_options)  # straight to the server, not counted


def _files(fs, url: str) -> dict[str, bytes]:
    return {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in fs.ls(url.removeprefix("s3://"), detail=False)
            if fs.isfile(p)}


def _markers(fs, url: str) -> list[str]:
    return [p for p in fs.find(f"{url}/.fastckpt/uploads") if p.endswith(".json")]  # SeaweedFS keeps the folder


def _adapters(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _config(proxied, url: str, **extra) -> dict:
    return {"root": url, "storage_options": proxied.storage_options, **extra}


def _two_saves(tmp_path, proxied, counter, url, between=None, config=None, **kwargs):
    """Two save_states of the LoRA model with a step between (``config``: fastckpt's, default straight to ``url``),
    each waited for; returns (accelerator, model, checkpointing, bytes sent by the first save, by the second, the
    stock folder of the second state)."""
    acc, model, opt = _setup(tmp_path, **kwargs)
    fast = fastckpt_accelerate.enable(acc, config or _config(proxied, url))
    _step(acc, model, opt)
    acc.save_state()
    fast.wait()
    first, counter.up = counter.up, 0
    if between is not None:
        between()
    _step(acc, model, opt)
    acc.save_state()
    fast.wait()
    second = counter.up
    stock = tmp_path / "stock"
    acc.project_configuration.automatic_checkpoint_naming = False  # stock would ignore output_dir
    type(acc).save_state(acc, str(stock))  # the same state by stock save_state: the reference
    acc.project_configuration.automatic_checkpoint_naming = True
    return acc, model, fast, first, second, {p.name: p.read_bytes() for p in stock.iterdir()}


def _assert_stock(got: dict[str, bytes], stock: dict[str, bytes]) -> None:
    assert set(got) == set(stock) | {"manifest.json"}, sorted(got)  # no records sidecar, nothing else of ours
    assert got["model.safetensors"] == stock["model.safetensors"]
    for name in set(stock) - {"model.safetensors"}:  # torch files: fastckpt's zip folder is "archive/", by value
        mine, theirs = (torch.load(io.BytesIO(d), weights_only=False) for d in (got[name], stock[name]))
        assert _same(mine, theirs), name


def _stock_load(tmp_path: Path, folder: dict[str, bytes]) -> dict:
    """``folder`` loaded by stock Accelerate ``load_state`` in a process that never imports fastckpt; returns the
    model's state as that process saw it."""
    src = tmp_path / "downloaded"
    src.mkdir()
    for name, data in folder.items():
        (src / name).write_bytes(data)
    code = textwrap.dedent(f"""
        import sys, torch
        from torch import nn
        from accelerate import Accelerator
        LAYERS = {LAYERS}
        class Lora(nn.Module):
            def __init__(self):
                super().__init__()
                for i in range(LAYERS):
                    setattr(self, f"l{{i}}_base", nn.Linear(1024, 2048, bias=False))
                    setattr(self, f"l{{i}}_lora", nn.Linear(1024, 4, bias=False))
        acc = Accelerator(cpu=True)
        model = Lora()
        opt = torch.optim.Adam([getattr(model, f"l{{i}}_lora").weight for i in range(LAYERS)], lr=1e-2)
        model, opt = acc.prepare(model, opt)
        acc.load_state(sys.argv[1])
        assert "fastckpt" not in sys.modules and "fastckpt_accelerate" not in sys.modules
        torch.save(acc.unwrap_model(model).state_dict(), sys.argv[2])
    """)
    done = run_child(code, str(src), str(tmp_path / "loaded.pt"))
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp_path / "loaded.pt", weights_only=True)


def test_second_save_state_sends_only_the_changed_bytes_and_the_folder_is_stock(tmp_path, counted):
    proxied, counter = counted
    url = proxied.fresh_url("accdedup")
    acc, model, fast, first, second, stock = _two_saves(tmp_path, proxied, counter, url, total_limit=2)
    try:
        stats = fast.checkpointer._saver.dedup
        fs = _fs(proxied)
        got = _files(fs, f"{url}/checkpoint_1")
        model_size = len(got["model.safetensors"])
        changed = _adapters(model) + sum(len(d) for n, d in got.items() if n != "model.safetensors")
        assert first > model_size  # the first save had nothing to copy from
        # each changed region (an adapter, and the small files sent whole) costs at most one 5 MiB part of slack
        assert second <= changed + LAYERS * MIN_PART + SLACK, f"sent {second} of {model_size + changed} bytes"
        assert stats.copied >= model_size - LAYERS * MIN_PART and stats.fell_back == 0
        _assert_stock(got, stock)
        listed = json.loads(got["manifest.json"])["files"]
        assert FIELD in listed["model.safetensors"]  # the next save's copy source: in fastckpt's own manifest
        assert s3_uploads(fs, url) == [] and not _markers(fs, url)  # no upload or marker left
        loaded = _stock_load(tmp_path, got)
        for key, value in acc.unwrap_model(model).state_dict().items():
            assert torch.equal(loaded[key], value), key
    finally:
        acc.end_training()


def deleting_source(fs, counter, url: str, when: str):
    """What runs between the two saves: deletes ``checkpoint_0`` now ("between-saves"), or makes the byte counter
    delete it when the first copy request reaches the store ("at-the-first-copy")."""
    def delete_source() -> None:
        fs.rm(f"{url}/checkpoint_0".removeprefix("s3://"), recursive=True)

    def between() -> None:
        if when == "between-saves":
            delete_source()
        else:
            counter.on_copy = delete_source

    return between


def uploaded_without_its_source(fs, url: str, stats, second: int, when: str) -> dict[str, bytes]:
    """The files of ``checkpoint_1`` once ``checkpoint_0`` was deleted ``when`` (see ``deleting_source``), after
    checking what the dedup did about it: nothing planned when the source went first (a full upload: ``second``
    bytes sent at least the model file), else the planned copies whose source went were sent instead."""
    assert not fs.exists(f"{url}/checkpoint_0/model.safetensors")
    got = _files(fs, f"{url}/checkpoint_1")
    if when == "between-saves":  # its manifest is gone too: nothing planned, a full upload
        assert stats.copied == 0 and second >= len(got["model.safetensors"])
    else:  # planned as copies: those whose source went are sent
        assert stats.fell_back > 0 and second >= stats.fell_back
    return got


@pytest.mark.parametrize("when", ["between-saves", "at-the-first-copy"])
def test_a_deleted_source_folder_is_sent_and_the_file_is_right(tmp_path, counted, when):
    """Retention (``total_limit``) may delete the older folder at any time: before the next save (a full upload), or
    right when the first copy of the save reaches the store (copies already made stay, which are complete copies;
    the rest is sent). Either way the new folder is whole and stock's."""
    proxied, counter = counted
    url = proxied.fresh_url(f"accdedup-{when}")
    fs = _fs(proxied)
    acc, model, fast, _, second, stock = _two_saves(tmp_path, proxied, counter, url,
                                                    deleting_source(fs, counter, url, when))
    try:
        got = uploaded_without_its_source(fs, url, fast.checkpointer._saver.dedup, second, when)
        _assert_stock(got, stock)
        assert s3_uploads(fs, url) == []
    finally:
        acc.end_training()


@pytest.mark.parametrize("forge", ["replaced-object", "forged-records"])
def test_a_stale_or_forged_source_sends_everything_and_nothing_is_wrong(tmp_path, counted, forge):
    proxied, counter = counted
    url = proxied.fresh_url(f"accdedup-{forge}")
    fs = _fs(proxied)
    old = f"{url}/checkpoint_0".removeprefix("s3://")

    def tamper() -> None:
        if forge == "replaced-object":  # same size, other bytes: the manifest's records are stale
            size = fs.size(f"{old}/model.safetensors")
            fs.pipe_file(f"{old}/model.safetensors", torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes())
        else:  # each frozen base claimed at another base's offset: a lie only the copies' CRC32C can catch
            doc = json.loads(fs.cat_file(f"{old}/manifest.json"))
            recs = doc["files"]["model.safetensors"][FIELD]
            bases = [r for r in recs if r[1] == 8 * MiB]
            assert len(bases) == LAYERS
            digests = [r[2] for r in bases]
            for r, d in zip(bases, digests[1:] + digests[:1]):
                r[2] = d
            fs.pipe_file(f"{old}/manifest.json", json.dumps(doc).encode())

    acc, model, fast, _, second, stock = _two_saves(tmp_path, proxied, counter, url, tamper)
    try:
        got = _files(fs, f"{url}/checkpoint_1")
        stats = fast.checkpointer._saver.dedup
        assert second >= len(got["model.safetensors"])  # everything sent
        assert stats.copied == 0 and stats.fell_back > 0  # planned as copies, every one caught by its CRC32C
        _assert_stock(got, stock)
        assert s3_uploads(fs, url) == []
    finally:
        acc.end_training()


# argv: URL OPTIONS TESTS_DIR PROJECT SAVED_PT WHERE WHEN. WHERE: "root" (folders straight to s3://) or "remote" (a
# local project dir, the remote tier uploads them); WHEN: "first" or "second", the state SAVED_PT keeps (the first
# save's, or the one the killed save would have written).
KILLED_CHILD = """
import os, sys, torch
sys.path.insert(0, sys.argv[3])
import fastckpt_accelerate
import fastckpt.storage.s3copy as s3copy
from test_accelerate_s3_dedup import _setup, _step
from pathlib import Path
url, options, where, when = sys.argv[1], eval(sys.argv[2]), sys.argv[6], sys.argv[7]
acc, model, opt = _setup(Path(sys.argv[4]))
config = ({"root": url, "storage_options": options} if where == "root"
          else {"remote": {"url": url, "storage_options": options}})
fast = fastckpt_accelerate.enable(acc, config)
_step(acc, model, opt)
acc.save_state()
fast.wait()
if when == "first":
    torch.save(acc.unwrap_model(model).state_dict(), sys.argv[5])
_step(acc, model, opt)
if when == "second":
    torch.save(acc.unwrap_model(model).state_dict(), sys.argv[5])

def die(*args, **kwargs):  # the second save's planned upload exists, its marker written: killed mid-parts
    os.kill(os.getpid(), 9)

s3copy.resending = die
acc.save_state()
fast.wait()
raise SystemExit("not killed")
"""


def test_sigkill_mid_save_keeps_the_previous_folder_and_the_next_start_aborts_the_upload(tmp_path, s3_fault_proxy):
    proxied = s3_fault_proxy
    url = proxied.fresh_url("accdedup-kill")
    fs = _fs(proxied)
    done = run_child(KILLED_CHILD, url, repr(proxied.server.storage_options), str(Path(__file__).parent),
                     str(tmp_path / "child"), str(tmp_path / "saved.pt"), "root", "first")
    assert done.returncode == -9, done.stderr[-3000:]
    assert len(s3_uploads(fs, url)) == 1  # the killed save's planned upload, left behind
    assert not fs.exists(f"{url}/checkpoint_1/manifest.json")
    previous = _files(fs, f"{url}/checkpoint_0")
    assert STOCK | {"manifest.json"} == set(previous)
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    acc, model, opt = _setup(tmp_path / "next")
    try:  # the next start: its first save claims the root and sweeps what the dead process left
        fast = fastckpt_accelerate.enable(acc, {"root": url, "storage_options": proxied.server.storage_options,
                                                "orphan_grace_s": 0})
        acc.load_state(f"{url}/checkpoint_0")
        for key, value in saved.items():
            assert torch.equal(acc.unwrap_model(model).state_dict()[key], value), key
        acc.project_configuration.iteration = 2
        acc.save_state()
        acc.wait_for_everyone()
        fast.wait()
        # a new process's first save copies from the root's newest committed folder (checkpoint_1 has no manifest)
        assert fast.checkpointer._saver.dedup.copied > 0
    finally:
        acc.end_training()
    assert s3_uploads(fs, url) == [] and not _markers(fs, url)


def test_a_resumed_run_takes_the_highest_numbered_folder_as_its_copy_source(tmp_path):
    """``checkpoint_10`` is newer than ``checkpoint_9`` (by name, they sort the other way)."""
    from fastckpt.engine.dedupwrite import DirectDedup
    from fastckpt.storage.local import LocalStorage

    for n in (8, 9, 10):
        folder = tmp_path / f"checkpoint_{n}"
        folder.mkdir()
        (folder / "manifest.json").write_text(json.dumps(
            {"format": "fastckpt", "version": 1, "layout": "files", "name": folder.name, "step": n, "files": {}}))
    (tmp_path / "checkpoint_11").mkdir()  # no manifest: never committed
    found = DirectDedup(LocalStorage(str(tmp_path)), enabled=True)._find_newest()
    assert found is not None and found.rstrip("/").endswith("checkpoint_10"), found


def _shared_save(rank: int, world: int, url: str, options: dict, out: str, phase: str) -> None:
    """Every process: the LoRA model under DDP on ``url`` (every process uploads its parts of the big files);
    ``first`` saves checkpoint_0, ``second`` (new processes: a resumed run) loads it, trains and saves checkpoint_1,
    then the same state by stock save_state into ``out/stock``."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = Lora()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    fast = fastckpt_accelerate.enable(acc, {"root": url, "storage_options": options})
    assert fast.shared_writes
    if phase == "second":
        acc.load_state(f"{url}/checkpoint_0")
    torch.manual_seed(10 if phase == "second" else 0)  # the same batch on every process: DDP's gradients agree
    _step(acc, model, opt)
    acc.save_state(f"{url}/checkpoint_{0 if phase == 'first' else 1}")
    acc.wait_for_everyone()
    fast.wait()
    if phase == "second":
        type(acc).save_state(acc, f"{out}/stock")
        if rank == 0:
            torch.save(acc.unwrap_model(model).state_dict(), f"{out}/model.pt")
    acc.wait_for_everyone()
    fast.close()


@pytest.mark.slow
def test_shared_uploads_of_a_resumed_run_copy_the_previous_folder(tmp_path, counted):
    """Several processes on s3:// (each uploads its parts of model.safetensors and optimizer.bin): the big files of
    checkpoint_1 copy their unchanged ranges from checkpoint_0's, whose records are under the root's .fastckpt/
    (never in the stock folder), found by new processes too."""
    from tests.dist_launcher import run_ranks

    proxied, counter = counted
    url = proxied.fresh_url("accdedup-shared")
    run_ranks(_shared_save, 2, url, proxied.storage_options, str(tmp_path), "first")
    first, counter.up = counter.up, 0
    run_ranks(_shared_save, 2, url, proxied.storage_options, str(tmp_path), "second")
    second = counter.up
    fs = _fs(proxied)
    got = _files(fs, f"{url}/checkpoint_1")
    stock = {p.name: p.read_bytes() for p in (tmp_path / "stock").iterdir()}
    model_size = len(got["model.safetensors"])
    changed = sum(len(d) for n, d in got.items() if n != "model.safetensors") + 3 * 16 * 1024
    assert first > model_size
    # each adapter's region costs at most one 5 MiB part (the processes' shares meet at the adapters)
    assert second <= changed + LAYERS * MIN_PART + SLACK, f"sent {second} of {model_size + changed} bytes"
    _assert_stock(got, stock)
    assert fs.exists(f"{url}/.fastckpt/records/model.safetensors.json")
    assert s3_uploads(fs, url) == [] and not _markers(fs, url)
    loaded = _stock_load(tmp_path, got)
    want = torch.load(tmp_path / "model.pt", weights_only=True)
    for key, value in want.items():
        assert torch.equal(loaded[key], value), key


@pytest.mark.parametrize("forge", ["replaced-object", "outside-the-root", "malformed", "huge"])
def test_stale_or_forged_root_records_give_no_copy_source(s3_root, forge):
    """The records under ``<root>/.fastckpt/records/`` (the shared uploads' copy source) are hostile input: a record
    whose object changed, that names an object outside a folder of the root, or that is not ours, gives nothing to
    copy (the file is then sent whole); only a matching one is used."""
    from fastckpt.format.rootrecords import root_records_path, save_records, source_records
    from fastckpt.storage.fsspec import FsspecStorage
    from fastckpt.storage.partplan import Record

    st = FsspecStorage(s3_root.url, s3_root.storage_options)
    old, new = f"{s3_root.url}/checkpoint_0/model.safetensors", f"{s3_root.url}/checkpoint_1/model.safetensors"
    data = torch.arange(2 * MiB, dtype=torch.int32).numpy().tobytes()
    st.write_checked(old, [memoryview(data)])
    save_records(st, old, len(data), [Record(0, len(data) // 2, "a" * 32), Record(len(data) // 2, len(data) // 2,
                                                                                    "b" * 32)])
    assert [r.key for r in source_records(st, new)] == [old, old]  # the genuine record: a source
    where = root_records_path(st, new)
    doc = json.loads(st.read_bytes(where))
    if forge == "replaced-object":  # same size, other bytes: the store's CRC32C differs
        st.write_checked(old, [memoryview(bytes(len(data)))])
    elif forge == "outside-the-root":
        st.write_atomic(where, json.dumps({**doc, "object": "s3://elsewhere/x/model.safetensors"}).encode())
    elif forge == "malformed":
        st.write_atomic(where, b'{"format": "fastckpt-root-records", "size": [')
    else:
        st.write_atomic(where, b" " * ((64 << 20) + 1))
    assert source_records(st, new) == []
