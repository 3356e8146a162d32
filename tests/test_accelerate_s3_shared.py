"""Accelerate's ``save_state`` on ``s3://`` with several processes (the test SeaweedFS, gloo ranks): every process
uploads its parts of ``model.safetensors`` and ``optimizer.bin`` (each ONE object, completed by process 0), the main
process writes the small files and ``manifest.json`` last; the folder equals stock ``save_state``'s of the same state
byte for byte, and stock ``load_state`` (no fastckpt) restores it bit-exact."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed as dist

from tests.dist_launcher import RanksFailed, run_ranks

pytestmark = pytest.mark.slow
BIG = ("model.safetensors", "optimizer.bin")


def _accelerator(rank: int, world: int, nodes: bool = False, saved_by: int | None = None):
    from accelerate import Accelerator
    from torch import nn

    # nodes: each process alone on its "node" (torchrun's LOCAL_* as on separate machines, its own local disk)
    local = dict(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1") if nodes else dict(LOCAL_RANK=str(rank),
                                                                            LOCAL_WORLD_SIZE=str(world))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1", **local)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    # 4 MiB per layer: each process holds more than S3's 5 MiB part of the model (21 MB over 2, 33.6 MB over 4)
    # and of the Adam state (twice that)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(5 if (saved_by or world) <= 2 else 8)], nn.BatchNorm1d(1024))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _train(acc, model, opt, rank: int) -> None:
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))  # BatchNorm's stats differ per rank
    acc.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


def _save(rank: int, world: int, url: str, options: dict, out: str, phase: str, nodes: bool = False) -> None:
    import fastckpt_accelerate

    acc, model, opt = _accelerator(rank, world, nodes)
    fast = fastckpt_accelerate.enable(acc, {"root": url, "storage_options": options})
    _train(acc, model, opt, rank)
    acc.save_state(f"{url}/checkpoint_0")
    acc.save_state(f"{url}/checkpoint_0")  # the same folder again, the first save maybe pending: it commits first
    acc.wait_for_everyone()
    _train(acc, model, opt, rank)
    if phase == "kill":
        from fastckpt.storage.s3parts import S3Parts

        upload = S3Parts.upload

        def one_part_then_die(self, path, upload_id, parts):
            upload(self, path, upload_id, parts[:1])  # one part of this process is in the upload, then it dies
            Path(out, "killed").touch()
            os.kill(os.getpid(), 9)

        def die(self, path, upload_id):
            # Process 0 dies too, before its abort: the launcher ends the job when a process dies, and whether
            # process 0's abort wins that race is luck; here it always loses, so the next start must clean up.
            os.kill(os.getpid(), 9)

        if rank == 1:
            S3Parts.upload = one_part_then_die
        else:
            S3Parts.abort = die
    acc.save_state(f"{url}/checkpoint_1")
    # the same state by stock save_state, locally (on this process's own disk with nodes): the reference
    type(acc).save_state(acc, f"{out}/stock{rank if nodes else ''}")
    acc.wait_for_everyone()
    written = {s.name: s.written_bytes for s in fast.stats}
    torch.save({"model": {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
                "written": written}, f"{out}/rank{rank}.pt")
    fast.close()  # not end_training(): that destroys the launcher's process group


def _stock_load(rank: int, world: int, folder: str, out: str, saved_by: int) -> None:
    import sys

    acc, model, opt = _accelerator(rank, world, saved_by=saved_by)
    acc.load_state(folder)
    assert "fastckpt_accelerate" not in sys.modules and "fastckpt" not in sys.modules
    torch.save({k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}, f"{out}/loaded.pt")


def _download(fs, url: str, dest: Path) -> dict[str, bytes]:
    dest.mkdir()
    files = {}
    for path in fs.ls(url.removeprefix("s3://"), detail=False):
        name = path.rsplit("/", 1)[-1]
        files[name] = fs.cat_file(path)
        (dest / name).write_bytes(files[name])
    return files


def _markers(fs, url: str) -> list[str]:
    return [p for p in fs.find(f"{url}/.fastckpt/uploads") if p.endswith(".json")]  # SeaweedFS keeps the folder


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy arrays in the RNG states
        return bool((a == b).all()) and a.dtype == b.dtype
    return a == b


def _uploads(fs, url: str) -> list:  # tests.helpers.s3_uploads's twin: helpers imports fastckpt, which _stock_load's
    # processes (this module, spawned) must not have imported
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])


# No plain 2-process case (until issue 55): "4" runs its code with four uploaders, "2-nodes" with two.
@pytest.mark.parametrize("world, nodes", [(2, True), (4, False)], ids=["2-nodes", "4"])
def test_every_process_uploads_its_parts_and_the_folder_is_stock_accelerates(tmp_path, s3_root, world, nodes) -> None:
    run_ranks(_save, world, s3_root.url, s3_root.storage_options, str(tmp_path), "save", nodes)
    fs = fsspec.filesystem("s3", **s3_root.storage_options)
    got = _download(fs, f"{s3_root.url}/checkpoint_1", tmp_path / "got")
    stock = {p.name: p.read_bytes() for p in tmp_path.glob("stock*/*")}  # with nodes: every process's own disk
    assert set(got) == set(stock) | {"manifest.json"}  # fastckpt's commit point; nothing else of ours is left
    assert got["model.safetensors"] == stock["model.safetensors"]  # its parts from every process: stock's bytes
    for name in set(stock) - {"model.safetensors"}:  # torch files: the same values. Not the same bytes: fastckpt's
        # zip archive folder is torch's "archive/" (as before this change), stock's the file's stem (index 30 on)
        mine, theirs = (torch.load(io.BytesIO(d), weights_only=False) for d in (got[name], stock[name]))
        assert _same(mine, theirs), name
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    for name in BIG:  # every process uploaded parts of each big object, and together all of it
        shares = [r["written"][f"checkpoint_1/{name}"] for r in ranks]
        assert all(s > 5 * 2**20 for s in shares), (name, shares)
        assert sum(shares) == len(got[name]), (name, shares)
    assert _uploads(fs, s3_root.url) == []
    run_ranks(_stock_load, 1, str(tmp_path / "got"), str(tmp_path), world)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    for key, value in ranks[0]["model"].items():
        assert torch.equal(loaded[key], value), key


def test_a_process_killed_mid_upload_commits_nothing_and_leaves_no_upload(tmp_path, s3_root) -> None:
    with pytest.raises(RanksFailed):
        run_ranks(_save, 2, s3_root.url, s3_root.storage_options, str(tmp_path), "kill")
    assert (tmp_path / "killed").exists()
    fs = fsspec.filesystem("s3", **s3_root.storage_options)
    names = {p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3_root.url}/checkpoint_1".removeprefix("s3://"), detail=False)} \
        if fs.exists(f"{s3_root.url}/checkpoint_1") else set()
    assert "manifest.json" not in names and not set(BIG) & names, names
    previous = _download(fs, f"{s3_root.url}/checkpoint_0", tmp_path / "previous")
    assert set(BIG) <= set(previous) and "manifest.json" in previous
    from fastckpt.format.checksum import crc32c

    records = json.loads(previous["manifest.json"])["files"]  # intact: every file as its manifest lists it
    for name, rec in records.items():
        assert (len(previous[name]), crc32c(previous[name])) == (rec["size"], rec["crc32c"]), name
    # Process 0 was killed too, before it could abort: the upload is left, with its marker in the root.
    assert [u["Key"].rsplit("/", 2)[-2:] for u in _uploads(fs, s3_root.url)] == [["checkpoint_1", "model.safetensors"]]
    assert len(_markers(fs, s3_root.url)) == 1  # the proof that it is fastckpt's
    run_ranks(_next_start, 2, s3_root.url, s3_root.storage_options)  # its first shared upload sweeps the root
    assert _uploads(fs, s3_root.url) == []
    assert fs.exists(f"{s3_root.url}/checkpoint_2/manifest.json")
    assert _markers(fs, s3_root.url) == []  # and its marker


def _next_start(rank: int, world: int, url: str, options: dict) -> None:
    import fastckpt_accelerate

    acc, model, opt = _accelerator(rank, world)
    fast = fastckpt_accelerate.enable(acc, {"root": url, "storage_options": options, "orphan_grace_s": 0})
    _train(acc, model, opt, rank)
    acc.save_state(f"{url}/checkpoint_2")
    fast.close()


def _fail(rank: int, world: int, url: str, options: dict, out: str) -> None:
    import fastckpt_accelerate
    from fastckpt.errors import FastCkptError, StorageError
    from fastckpt.storage.s3parts import S3Parts

    acc, model, opt = _accelerator(rank, world)
    fast = fastckpt_accelerate.enable(acc, {"root": url, "storage_options": options})
    _train(acc, model, opt, rank)
    acc.save_state(f"{url}/checkpoint_0")
    acc.wait_for_everyone()
    if rank == 1:
        def refused(self, path, upload_id, parts):
            raise StorageError(f"the store refused the parts of {path} (injected on process 1)")

        S3Parts.upload = refused
    _train(acc, model, opt, rank)
    acc.save_state(f"{url}/checkpoint_1")
    errors = []
    for finish in (acc.wait_for_everyone, fast.close):  # each error raised once: the shared files' (every
        try:  # process), then on the main process its folder's, which waited for them
            finish()
        except FastCkptError as e:
            errors.append(str(e))
    Path(out, f"error{rank}").write_text("\n".join(errors))


def test_a_process_whose_upload_fails_fails_the_folder_on_every_process(tmp_path, s3_root) -> None:
    run_ranks(_fail, 2, s3_root.url, s3_root.storage_options, str(tmp_path))
    for rank in range(2):  # the same verdict on each process, naming the failing one and the file
        text = (tmp_path / f"error{rank}").read_text()
        assert "injected on process 1" in text and "checkpoint_1/model.safetensors" in text, text
    fs = fsspec.filesystem("s3", **s3_root.storage_options)
    assert not fs.exists(f"{s3_root.url}/checkpoint_1/manifest.json")
    assert not fs.exists(f"{s3_root.url}/checkpoint_1/model.safetensors")
    assert fs.exists(f"{s3_root.url}/checkpoint_0/manifest.json")
    assert _uploads(fs, s3_root.url) == [] and _markers(fs, s3_root.url) == []  # process 0 aborted them
