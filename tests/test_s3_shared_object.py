"""One torch file on S3 uploaded by every data-parallel rank: the parts of one multipart upload
(``save_file`` with ``distributed=True`` on ``s3://``, ``fastckpt.engine.sharedobject``), on gloo ranks against the
test SeaweedFS. The ranks see no common local disk (each its own tmp folder: simulated nodes), only the bucket."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import NamedTuple

import fsspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, StorageError
from fastckpt.engine.partplan import MIN_PART
from tests.dist_launcher import rank_report, run_ranks, same_replicas
from tests.helpers import assert_bit_equal, assert_same_torch_file, clone_state, s3_uploads

pytestmark = pytest.mark.slow
NAME = "epoch=0-step=7.ckpt"


def _replica(rank: int, layers: int = 7) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Identical parameters and AdamW state on every rank (as DDP keeps them), BatchNorm statistics of its own:
    about 25 MB of records in 1 MB tensors, so that 4 ranks each hold more than S3's 5 MiB smallest part."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.BatchNorm1d(512), *[nn.Linear(512, 512) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(1))
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    same_replicas(model, opt)
    with torch.no_grad():  # this rank's own batch: BatchNorm's running statistics now differ per rank
        model(torch.randn(16, 512, generator=torch.Generator().manual_seed(100 + rank)) * (rank + 1))
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> dict:
    # The pickled bytes differ per rank (a note of its own length): every record's offset differs too.
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": step,
            "note": "r" * (997 * rank)}


def _config(url: str, options: dict) -> CheckpointConfig:
    return CheckpointConfig(root=url, storage_options=options, orphan_grace_s=0)


def _share(rank: int, world: int, url: str, options: dict, out: str, layers: int = 7) -> None:
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=f"node{rank}-")  # no local folder in common: simulated nodes
    model, opt = _replica(rank, layers)
    with Checkpointer(_config(url, options), distributed=True) as ckpt:
        ckpt.watch(opt)
        state = _state(model, opt, rank, 7)
        ref = clone_state(state)
        handle = ckpt.save_file(state, NAME, step=7)
        if rank == 0:  # the very state saved as Lightning's stock save does (into a buffer), before it changes
            buf = io.BytesIO()
            torch.save(state, buf)
            (Path(out) / "stock.ckpt").write_bytes(buf.getvalue())
        ckpt.wait_staged()
        with torch.no_grad():  # the snapshot was taken: changing everything now must not reach the object
            for p in model.parameters():
                p.add_(1.0)
        handle.wait()
        written = [None] * world
        dist.all_gather_object(written, handle.stats.written_bytes)
        torch.save({"ref": ref, "written": written, "nbytes": handle.stats.nbytes}, Path(out) / f"rank{rank}.pt")


def _fs(options: dict):
    return fsspec.filesystem("s3", **options)


def _uploads(options: dict, url: str) -> list[dict]:
    return s3_uploads(_fs(options), url)


def _markers(fs, url: str) -> list[str]:
    fs.invalidate_cache()
    return [p for p in fs.find(f"{url}/.fastckpt/uploads") if p.endswith(".json")]  # SeaweedFS keeps the folder


def _plain_load(data: bytes, tmp: Path) -> None:
    """``torch.load`` of the object's bytes in a process that never imports fastckpt."""
    path = tmp / "plain.ckpt"
    path.write_bytes(data)
    check = ("import sys, torch; s = torch.load(sys.argv[1], weights_only=True); "
             "assert not any(m.startswith('fastckpt') for m in sys.modules); print(s['global_step'])")
    done = subprocess.run([sys.executable, "-c", check, str(path)], capture_output=True, text=True, timeout=120,
                          cwd="/")
    assert done.returncode == 0 and done.stdout.strip() == "7", done.stderr[-3000:]


# 4 ranks only: a 2-rank case (until issue 55) ran the same code with two uploaders instead of four (no middle one).
@pytest.mark.parametrize("world", [4])
def test_every_rank_uploads_its_parts_of_one_object(tmp_path, s3_root, world):
    run_ranks(_share, world, s3_root.url, s3_root.storage_options, str(tmp_path))
    fs = _fs(s3_root.storage_options)
    key = f"{s3_root.url}/{NAME}"
    data = fs.cat_file(key)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    written = ranks[0]["written"]
    print(f"{world} ranks uploaded {written} bytes of {len(data)}")
    assert all(w >= MIN_PART for w in written), f"every rank uploaded parts of the object: {written}"
    assert sum(written) == len(data) == ranks[0]["nbytes"], "the parts add up to the object, no overlap"
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert_bit_equal(loaded, ranks[0]["ref"])  # rank 0's pickle, the parameters from whoever uploaded them
    for buffer in ("1.running_mean", "1.running_var"):  # rank 0's: had rank 1 sent its own, the above would fail
        assert not torch.equal(loaded["state_dict"][buffer], ranks[1]["ref"]["state_dict"][buffer]), buffer
    assert_same_torch_file(data, (tmp_path / "stock.ckpt").read_bytes())
    _plain_load(data, tmp_path)
    assert _uploads(s3_root.storage_options, s3_root.url) == [], "no multipart upload left in progress"
    assert _markers(fs, s3_root.url) == [], "every marker removed"
    # Its health record, from every rank's statistics: the sidecar rank 0 writes after the commit.
    record = json.loads(fs.cat_file(f"{s3_root.url}/.{NAME}.fastckpt-health.json"))
    assert record["step"] == 7 and record["size"] == len(data)
    assert record["health"]["healthy"] is True and record["health"]["complete"] is True
    from fastckpt.format.health import file_health  # ...tied to the object's bytes: believed as its own
    from fastckpt.storage.protocol import open_storage
    assert file_health(open_storage(s3_root.url, s3_root.storage_options), f"{s3_root.url}/{NAME}")["healthy"]


# ---- a rank killed mid-upload ------------------------------------------------------------------------------------


def _killed_entry(rank: int, world: int, folder: str, victims: tuple[int, ...], url: str, options: dict) -> None:
    """One rank of a job that first saves ``NAME`` whole (the previous object, its bytes kept in ``previous``),
    then saves it again with a fresh ``Checkpointer``, in which ``victims`` SIGKILL themselves once their first part
    is up (not through ``run_ranks``, which kills every rank as soon as one dies: here the survivors must abort the
    upload). The previous object comes from the same launch: a launch of its own cost every rank its imports."""
    log = open(os.path.join(folder, f"rank{rank}.log"), "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{folder}/store")
    model, opt = _replica(rank)
    try:
        with Checkpointer(_config(url, options), distributed=True) as ckpt:  # the previous object, committed
            ckpt.save_file(_state(model, opt, rank, 7), NAME, step=7).wait()
        if rank == 0:
            Path(folder, "previous").write_bytes(_object(options, url))
        dist.barrier()  # the previous object is read before any rank starts the next save
        if rank in victims:
            from fastckpt.storage.s3parts import S3Parts

            upload = S3Parts.upload

            def first_part_then_die(self, path, upload_id, parts):
                out = upload(self, path, upload_id, parts[:1])  # one part of this rank is in the upload...
                Path(folder, f"part-up-{rank}").write_text(repr(out))
                os.kill(os.getpid(), signal.SIGKILL)  # ...and the rank dies before the rest

            S3Parts.upload = first_part_then_die
        with Checkpointer(_config(url, options), distributed=True) as ckpt:
            ckpt.watch(opt)
            with pytest.raises(StorageError) as raised:
                ckpt.save_file(_state(model, opt, rank, 8), NAME, step=8).wait()
            Path(folder, f"error-{rank}").write_text(str(raised.value))
    except BaseException:
        traceback.print_exc()
        raise
    os._exit(0)  # the group lost a rank: no teardown collective could complete


def _run_killed(tmp_path: Path, victims: tuple[int, ...], url: str, options: dict, world: int = 2) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="fastckpt-killed-", dir=tmp_path))
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_killed_entry, args=(r, world, str(folder), victims, url, options))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    report = rank_report(folder)
    assert not alive, f"ranks hung after a rank died:{report}"
    codes = [p.exitcode for p in procs]
    assert codes == [-signal.SIGKILL if r in victims else 0 for r in range(world)], f"{codes}{report}"
    for r in victims:
        assert (folder / f"part-up-{r}").exists(), f"rank {r} died before its first part was up{report}"
    assert torch.load(io.BytesIO((folder / "previous").read_bytes()), weights_only=True)["global_step"] == 7
    return folder


def _object(options: dict, url: str) -> bytes:
    fs = _fs(options)
    fs.invalidate_cache()
    return fs.cat_file(f"{url}/{NAME}")


def test_a_rank_killed_mid_upload_aborts_it_and_leaves_the_previous_object(tmp_path, s3_root):
    url, options = s3_root.url, s3_root.storage_options
    folder = _run_killed(tmp_path, (1,), url, options)
    before = (folder / "previous").read_bytes()
    error = (folder / "error-0").read_text()
    assert "failed" in error and NAME in error, error
    assert _object(options, url) == before, "the previous object is intact"
    assert _uploads(options, url) == [], "rank 0 aborted the upload: no part left billed"
    assert _markers(_fs(options), url) == [], "and removed its marker"


def test_an_upload_whose_ranks_all_died_is_swept_at_the_next_start(tmp_path, s3_root):
    url, options = s3_root.url, s3_root.storage_options
    before = (_run_killed(tmp_path, (0, 1), url, options) / "previous").read_bytes()
    assert _object(options, url) == before, "the previous object is intact"
    left = _uploads(options, url)
    assert len(left) == 1 and left[0]["Key"].endswith(NAME), f"the killed save's upload is left: {left}"
    assert len(_markers(_fs(options), url)) == 1, "with the marker that proves it fastckpt's"
    run_ranks(_share, 2, url, options, str(tmp_path))  # the next start: rank 0 sweeps before its first upload
    assert _uploads(options, url) == [], "the orphaned upload was aborted"
    assert _markers(_fs(options), url) == []
    assert torch.load(io.BytesIO(_object(options, url)), weights_only=True)["global_step"] == 7


def test_the_sweep_aborts_only_uploads_a_marker_proves_fastckpts(s3_root):
    """``fastckpt gc`` and the Lightning plugin's first use of a folder (``collect_temp_files``) abort the uploads of
    dead shared saves: exactly those a marker of another process names, for an object of this folder or of one
    folder in it."""
    from fastckpt.storage.protocol import open_storage
    from fastckpt.tiers.gc import collect_temp_files

    url, options = s3_root.url, s3_root.storage_options
    storage = open_storage(url, options)
    parts = storage.multipart()

    def marker(uid: str, path: str, upload_id: str, process: str = "a-process-that-died") -> str:
        doc = {"fastckpt": "multipart upload", "key": path, "upload_id": upload_id, "process": process}
        mpath = f"{url}/.fastckpt/uploads/{uid}.json"
        storage.write_atomic(mpath, json.dumps(doc).encode())
        return mpath

    dead = parts.create(f"{url}/dead.ckpt")  # a save killed after create: its marker names it
    dead_marker = marker("a1", f"{url}/dead.ckpt", dead)
    foreign = parts.create(f"{url}/theirs.ckpt")  # someone else's upload, no marker: never touched
    # a marker naming an object outside this folder and its folders (Accelerate's checkpoint_N/) proves nothing
    elsewhere = parts.create(f"{url}/sub/deeper/deep.ckpt")
    marker("a2", f"{url}/sub/deeper/deep.ckpt", elsewhere)
    nested = parts.create(f"{url}/checkpoint_3/model.safetensors")  # one folder down: Accelerate's shared files
    nested_marker = marker("a4", f"{url}/checkpoint_3/model.safetensors", nested)
    live = parts.create(f"{url}/live.ckpt")  # this process's own upload may be in flight: never swept by it
    marker("a3", f"{url}/live.ckpt", live, process=json.loads(parts.marker_bytes("x", "y"))["process"])
    assert collect_temp_files(storage, 0, dry_run=True) == [dead_marker, nested_marker]
    assert dead in parts.in_progress(f"{url}/dead.ckpt"), "a dry run aborts nothing"
    assert collect_temp_files(storage, 0) == [dead_marker, nested_marker]
    assert parts.in_progress(f"{url}/dead.ckpt") == []
    assert parts.in_progress(f"{url}/checkpoint_3/model.safetensors") == []
    assert parts.in_progress(f"{url}/theirs.ckpt") == [foreign]
    assert parts.in_progress(f"{url}/sub/deeper/deep.ckpt") == [elsewhere]
    assert parts.in_progress(f"{url}/live.ckpt") == [live]
    assert collect_temp_files(storage, 3600) == [], "a marker younger than the grace is left alone"
    for path, upload_id in ((f"{url}/theirs.ckpt", foreign), (f"{url}/sub/deeper/deep.ckpt", elsewhere),
                            (f"{url}/live.ckpt", live)):
        assert parts.abort(path, upload_id)


def _rank0_commit_raises(rank: int, world: int, url: str, options: dict, out: str) -> None:
    """Rank 0's own part of the commit (fixing the object's bytes) raises: every rank must fail the save with rank
    0's verdict, none left waiting in a collective, and the previous object is untouched."""
    from fastckpt.engine.sharedobject import SharedObjectWrite

    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=f"node{rank}-")
    if rank == 0:
        def broken(self, merged):
            raise ValueError("injected: rank 0 cannot build the fixed bytes")
        SharedObjectWrite._fixed = broken  # this process is rank 0's alone
    model, opt = _replica(rank, layers=1)
    with Checkpointer(_config(url, options), distributed=True) as ckpt:
        ckpt.watch(opt)
        handle = ckpt.save_file(_state(model, opt, rank, 7), NAME, step=7)
        try:
            handle.wait()
        except StorageError as e:
            Path(out, f"rank{rank}.txt").write_text(str(e))
        else:
            Path(out, f"rank{rank}.txt").write_text("committed")


# ---- three 2-rank saves in one launch ----------------------------------------------------------------------------


def _three_saves(rank: int, world: int, options: dict, proxied: dict, urls: dict[str, str], out: str) -> None:
    """The three 2-rank cases below, one after the other in the same two processes, each a fresh ``Checkpointer`` on
    a folder of its own: a launch costs every rank its imports (torch, torch._dynamo at the optimizer's first use,
    botocore's endpoint data), seconds of CPU each."""
    _share(rank, world, urls["small"], options, f"{out}/small", 0)
    _share(rank, world, urls["flipped"], proxied, f"{out}/flipped")  # through the proxy that damages a part
    _rank0_commit_raises(rank, world, urls["broken"], options, f"{out}/broken")  # last: rank 0's commit stays broken


class ThreeSaves(NamedTuple):
    urls: dict[str, str]
    out: Path  # each case's files in its own folder
    options: dict  # straight to the server
    flipped: bool  # the proxy damaged the flipped case's upload stream
    printed: str  # every rank's output


@pytest.fixture(scope="module")
def three_saves(s3_server, tmp_path_factory) -> ThreeSaves:
    from tests.faultproxy import FaultProxy
    from tests.s3server import fail_fast_storage_options
    from tests.test_s3_checksums import FlipOnce

    out = tmp_path_factory.mktemp("three-saves")
    urls = {case: s3_server.fresh_url(case) for case in ("small", "flipped", "broken")}
    for case in urls:
        (out / case).mkdir()
    with FaultProxy(("127.0.0.1", s3_server.port), name="s3-faultproxy") as proxy:
        flip = FlipOnce(8 << 20)  # 8 MiB into the upload stream of both ranks: inside a part's body
        proxy.rewrite = flip  # only the flipped case goes through the proxy
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # run_ranks echoes every rank's output on success
            run_ranks(_three_saves, 2, s3_server.storage_options, fail_fast_storage_options(proxy.endpoint_url), urls,
                      str(out))
    print(printed.getvalue())
    return ThreeSaves(urls, out, s3_server.storage_options, flip.flipped.is_set(), printed.getvalue())


def test_a_file_smaller_than_a_part_goes_up_as_one_part_from_one_rank(three_saves):
    # 3 MB: one part (S3's smallest but the last is 5 MiB); the other rank's records reach its owner over gloo.
    url, tmp, options = three_saves.urls["small"], three_saves.out / "small", three_saves.options
    data = _object(options, url)
    written = torch.load(tmp / "rank0.pt", weights_only=False)["written"]
    assert sorted(written) == [0, len(data)] and len(data) < MIN_PART, written
    assert_same_torch_file(data, (tmp / "stock.ckpt").read_bytes())
    assert _uploads(options, url) == []


def test_a_part_damaged_in_flight_is_sent_again(three_saves):
    url, tmp, options = three_saves.urls["flipped"], three_saves.out / "flipped", three_saves.options
    assert three_saves.flipped
    resent = [line for line in three_saves.printed.splitlines() if "were sent again (damaged in flight)" in line]
    assert any(url.removeprefix("s3://") in line for line in resent), "the store rejected the part"
    data = _object(options, url)
    assert_same_torch_file(data, (tmp / "stock.ckpt").read_bytes())  # the damaged bytes never made it in
    assert _uploads(options, url) == []


def test_rank_0_failing_its_commit_fails_every_rank_without_a_hang(three_saves) -> None:
    """A rank-0-only step of the protocol raising (a format's digest, a plan) is shared as the verdict at the next
    collective: every rank raises the same StorageError naming it, no upload is left open, no object appears."""
    url, tmp, options = three_saves.urls["broken"], three_saves.out / "broken", three_saves.options
    verdicts = [(tmp / f"rank{r}.txt").read_text() for r in range(2)]
    assert all("rank 0 commit" in v and "injected" in v for v in verdicts), verdicts
    assert not _fs(options).exists(f"{url}/{NAME}".removeprefix("s3://"))
    assert _uploads(options, url) == []
