"""The remote tier: local commit first, then a background upload, manifest last (memory:// and real S3)."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest
import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, CheckpointInfo, StorageError
from fastckpt.storage.local import LocalStorage
from fastckpt.storage.protocol import Storage, open_storage
from tests.helpers import FaultyStorage, GatedStorage, assert_bit_equal, clone_state
from tests.helpers import listed as _listed

REPO = Path(__file__).resolve().parents[1]


def _state(v: float) -> dict:
    """Deterministic in ``v``: several shards at chunk_bytes=64 KiB, mixed dtypes, plain leaves."""
    g = torch.Generator().manual_seed(int(v * 1000))
    return {
        "model": {"w": torch.randn(256, 256, generator=g), "b": torch.full((300,), v, dtype=torch.bfloat16),
                  "idx": torch.arange(5000, dtype=torch.int64) * int(v)},
        "step": int(v), "lr": v / 10, "nan": float("nan"), "tag": ("run", [1, 2]),
    }


def _memory_url() -> str:
    return f"memory://fastckpt-remote-{uuid.uuid4().hex[:12]}"


def _forget_memory(url: str) -> None:
    import fsspec

    fs = fsspec.filesystem("memory")
    if fs.exists(url.removeprefix("memory://")):
        fs.rm(url.removeprefix("memory://"), recursive=True)


@pytest.fixture(params=["memory", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request) -> dict:
    """The `remote:` config section of a fresh, empty remote tier."""
    if request.param == "memory":
        url = _memory_url()
        yield {"url": url}
        _forget_memory(url)
    else:
        s3 = request.getfixturevalue("s3_root")
        yield {"url": s3.url, "storage_options": s3.storage_options}


@pytest.fixture
def memory_remote() -> str:
    url = _memory_url()
    yield url
    _forget_memory(url)


def _cfg(root: Path, remote: dict, **kw) -> CheckpointConfig:
    return CheckpointConfig(root=str(root), persist={"chunk_bytes": 65536}, remote=remote, **kw)


def _remote_dir(storage: Storage, name: str) -> str:
    return storage.join(storage.url, name)


def _assert_same_copy(local_root: Path, remote: Storage, name: str) -> None:
    """The remote copy holds the local manifest's exact bytes and every file it lists, size for size."""
    rdir = _remote_dir(remote, name)
    manifest = (local_root / name / "manifest.json").read_bytes()
    assert remote.read_bytes(remote.join(rdir, "manifest.json")) == manifest
    files = json.loads(manifest)["files"]
    assert len(files) >= 3  # several shards + meta
    for fname, rec in files.items():
        assert remote.size(remote.join(rdir, fname)) == rec["size"] == (local_root / name / fname).stat().st_size
    assert sorted(remote.listdir(rdir)) == sorted([*files, "manifest.json"])


def _upload_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith(("fastckpt-upload", "fastckpt-up-"))}


# ---- 1. a bit-exact remote copy ----------------------------------------------------------

def test_upload_is_a_bit_exact_copy(tmp_path, remote) -> None:
    state = _state(1.0)
    ref = clone_state(state)
    before = _upload_threads()
    with Checkpointer(_cfg(tmp_path / "local", remote)) as ckpt:
        h = ckpt.save(state, step=1)
        local = h.wait()
        assert local.path == str(tmp_path / "local" / "step-000000001")  # wait() still means "committed locally"
        info = h.wait_uploaded()
        assert h.uploaded()
        rs = ckpt.remote_storage
        assert info == CheckpointInfo("step-000000001", 1, _remote_dir(rs, "step-000000001"), local.nbytes,
                                      healthy=True)  # the health record travels with the manifest
        _assert_same_copy(tmp_path / "local", rs, "step-000000001")
        assert ckpt.list() == [local]  # both tiers hold it: the local copy is preferred
        assert ckpt.reader().storage is ckpt.storage
        assert {n.rsplit("-", 1)[0].split("_")[0] for n in _upload_threads() - before} == {
            "fastckpt-upload", "fastckpt-up"}
    assert _upload_threads() - before == set()  # both stop in close()

    # another machine: a new, empty local root and the same remote
    with Checkpointer(_cfg(tmp_path / "fresh", remote)) as other:
        assert other.latest() == 1
        assert other.list() == [info]
        assert other.exists("step-000000001") and not other.exists("step-000000002")
        reader = other.reader()
        assert reader.storage is other.remote_storage
        assert_bit_equal(ref, other.load())
        assert_bit_equal(ref, other.load(step=1))
        assert_bit_equal(ref, other.load(name="step-000000001"))
    assert not (tmp_path / "fresh").exists() or not any((tmp_path / "fresh").iterdir())


def test_without_remote_tier_wait_uploaded_is_wait(tmp_path) -> None:
    before = _upload_threads()
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        h = ckpt.save(_state(1.0), step=1)
        assert h.wait_uploaded() == h.wait() and h.uploaded()
        assert ckpt.remote_storage is None and _upload_threads() == before


@pytest.mark.s3
def test_big_file_goes_up_as_multipart_from_the_mapping(tmp_path, s3_root) -> None:
    import fsspec

    state = {"big": torch.randn(12 << 20, generator=torch.Generator().manual_seed(3))}  # 48 MiB in one shard
    ref = clone_state(state)
    remote = {"url": s3_root.url, "storage_options": s3_root.storage_options}
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "local"), remote=remote)) as ckpt:
        ckpt.save(state, step=1).wait_uploaded()
    fs = fsspec.filesystem("s3", **s3_root.storage_options)
    shard = next(p for p in fs.ls(s3_root.url.removeprefix("s3://") + "/step-000000001") if p.endswith(".safetensors"))
    assert fs.info(shard)["ETag"].strip('"').endswith("-4"), "expected a 4-part multipart upload"
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "fresh"), remote=remote)) as other:
        assert_bit_equal(ref, other.load())


# ---- 2. the machine is lost ------------------------------------------------------------------

def test_resume_from_remote_after_local_root_is_lost(tmp_path, remote) -> None:
    root = tmp_path / "local"
    cfg = _cfg(root, remote)
    with Checkpointer(cfg) as ckpt:
        for step in (1, 2):
            ckpt.save(_state(float(step)), step=step)
        ckpt.wait()  # committed locally and uploaded
    shutil.rmtree(root)
    with Checkpointer(cfg) as ckpt:
        assert ckpt.latest() == 2 and [i.step for i in ckpt.list()] == [1, 2]
        assert_bit_equal(_state(2.0), ckpt.load())
        assert_bit_equal(_state(1.0), ckpt.load(step=1))
        target = clone_state(_state(0.0))
        ckpt.load_into(target)
        assert_bit_equal(_state(2.0)["model"], target["model"])
        ckpt.save(_state(3.0), step=3).wait_uploaded()  # training goes on, both tiers again
        assert [i.step for i in ckpt.list()] == [1, 2, 3]
        assert _listed(root) == ["step-000000003"]
        assert ckpt.reader(step=3).storage is ckpt.storage and ckpt.reader(step=2).storage is ckpt.remote_storage


# ---- 3. upload failures ------------------------------------------------------------------------

def test_upload_failure_is_raised_once_and_the_local_copy_survives(tmp_path, memory_remote) -> None:
    faulty = FaultyStorage(open_storage(memory_remote), fail_on=2, err=errno.ECONNRESET)
    cfg = _cfg(tmp_path, {"url": memory_remote, "workers": 1})
    with Checkpointer(cfg, remote_storage=faulty) as ckpt:
        h = ckpt.save(_state(1.0), step=1)
        h.wait()  # committed locally: the upload's failure does not change that
        with pytest.raises(StorageError) as ei:
            ckpt.wait()
        rdir = _remote_dir(faulty, "step-000000001")
        msg = str(ei.value)
        assert rdir in msg and "Checkpointer.upload('step-000000001')" in msg and str(tmp_path) in msg
        assert isinstance(ei.value.__cause__, OSError) and ei.value.__cause__.errno == errno.ECONNRESET
        ckpt.wait()  # raised once
        assert h.done() and not h.uploaded()
        assert not faulty.exists(faulty.join(rdir, "manifest.json"))
        assert faulty.listdir(rdir) == []  # the torn file and the complete one are both gone
        assert ckpt.reader().storage is ckpt.storage
        assert_bit_equal(_state(1.0), ckpt.load())

        ckpt.save(_state(2.0), step=2).wait_uploaded()  # later saves are uploaded as usual
        again = ckpt.upload("step-000000001").result(60)  # the retry the message suggests
        assert again.path == rdir
        _assert_same_copy(tmp_path, faulty, "step-000000001")
        _assert_same_copy(tmp_path, faulty, "step-000000002")


def test_upload_failure_is_raised_by_the_next_save(tmp_path, memory_remote) -> None:
    faulty = FaultyStorage(open_storage(memory_remote), fail_on=1)
    with Checkpointer(_cfg(tmp_path, {"url": memory_remote}), remote_storage=faulty) as ckpt:
        ckpt.save(_state(1.0), step=1).wait()
        # a barrier that raises nothing: its remote part runs on the upload thread after the failed upload
        ckpt.delete("no-such-checkpoint").result(30)
        with pytest.raises(StorageError, match="step-000000001"):
            ckpt.save(_state(2.0), step=2)
        h = ckpt.save(_state(2.0), step=2)  # raised once
        assert h.wait_uploaded().step == 2
        ckpt.wait()

        faulty.writes, faulty.fail_on = 0, 1
        h3 = ckpt.save(_state(3.0), step=3)
        with pytest.raises(StorageError, match="ENOSPC"):
            h3.wait_uploaded()  # reported through the handle ...
        ckpt.wait()  # ... so not raised again
        assert ckpt.latest() == 3 and ckpt.reader().storage is ckpt.storage
        assert_bit_equal(_state(3.0), ckpt.load())


@pytest.mark.s3
def test_upload_cut_mid_file_over_s3(tmp_path, s3_fault_proxy) -> None:
    url = s3_fault_proxy.fresh_url("remote-cut")
    remote = {"url": url, "storage_options": s3_fault_proxy.storage_options, "workers": 1}
    big = lambda v: {"w": torch.full((1024, 1024), v), "step": int(v)}  # noqa: E731 - a 4 MiB shard
    cfg = CheckpointConfig(root=str(tmp_path / "local"), persist={"chunk_bytes": 2 << 20}, remote=remote)
    with Checkpointer(cfg) as ckpt:
        rs = ckpt.remote_storage
        ckpt.save(big(1.0), step=1).wait_uploaded()
        s3_fault_proxy.proxy.cut_upload_after(1 << 20)  # the connection dies 1 MiB into the next upload
        h = ckpt.save(big(2.0), step=2)
        h.wait()
        with pytest.raises(StorageError) as ei:
            ckpt.wait()
        assert s3_fault_proxy.proxy.cut.is_set()
        assert f"{url}/step-000000002" in str(ei.value) and isinstance(ei.value.__cause__, Exception)
        ckpt.wait()  # once
        s3_fault_proxy.proxy.pass_through()
        assert not rs.exists(f"{url}/step-000000002/manifest.json")
        assert_bit_equal(big(2.0), ckpt.load(step=2))  # the local copy
        ckpt.save(big(3.0), step=3).wait_uploaded()  # the network is back: uploads work again
        assert rs.listdir(f"{url}/step-000000002") == []  # partial files removed once it could be
        ckpt.upload("step-000000002").result(60)
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "fresh"), remote=remote)) as other:
        assert [i.step for i in other.list()] == [1, 2, 3]
        for step in (1, 2, 3):
            assert_bit_equal(big(float(step)), other.load(step=step))


@pytest.mark.s3
def test_unreachable_remote_is_raised_at_close(tmp_path, s3_fault_proxy) -> None:
    url = s3_fault_proxy.fresh_url("remote-down")
    cfg = _cfg(tmp_path / "local", {"url": url, "storage_options": s3_fault_proxy.storage_options},
               network={"timeout_s": 5, "retries": 1, "backoff_s": 0.1})
    ckpt = Checkpointer(cfg)  # reachable when built (an unreachable remote.url fails here: test_storage_check.py)
    s3_fault_proxy.proxy.refuse()
    ckpt.save(_state(1.0), step=1).wait()
    with pytest.raises(StorageError) as ei:
        ckpt.close()
    assert f"{url}/step-000000001" in str(ei.value)
    ckpt.close()  # idempotent, raised once
    s3_fault_proxy.proxy.pass_through()
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "local"))) as local_only:
        assert_bit_equal(_state(1.0), local_only.load())
    rs = open_storage(url, s3_fault_proxy.server.storage_options)
    assert not rs.exists(f"{url}/step-000000001/manifest.json")


# ---- 4. retention -------------------------------------------------------------------------------

def test_local_retention_keeps_checkpoints_whose_upload_is_pending(tmp_path, memory_remote) -> None:
    gated = GatedStorage(open_storage(memory_remote))
    root = tmp_path / "local"
    cfg = _cfg(root, {"url": memory_remote, "keep_last": 2}, retention={"keep_last": 1})
    with Checkpointer(cfg, remote_storage=gated) as ckpt:
        handles = [ckpt.save(_state(1.0), step=1)]
        handles[0].wait()
        assert gated.entered.wait(10)  # the upload of step 1 is held
        for step in (2, 3):
            handles.append(ckpt.save(_state(float(step)), step=step))
            handles[-1].wait()
        assert not any(h.uploaded() for h in handles)
        # local keep_last=1 would have removed 1 and 2, but their uploads are pending
        assert _listed(root) == ["step-000000001", "step-000000002", "step-000000003"]
        gated.gate.set()
        ckpt.wait()  # uploads done, and the local retention they allowed has run
        assert all(h.uploaded() for h in handles)
        assert _listed(root) == ["step-000000003"]
        # remote keep_last=2 removed only the oldest remote copy
        assert sorted(n for n in gated.listdir(gated.url)) == ["step-000000002", "step-000000003"]
        assert [(i.step, i.path) for i in ckpt.list()] == [(2, _remote_dir(gated, "step-000000002")),
                                                           (3, str(root / "step-000000003"))]
        assert_bit_equal(_state(2.0), ckpt.load(step=2))


def test_remote_retention_leaves_local_copies_alone(tmp_path, memory_remote) -> None:
    root = tmp_path / "local"
    with Checkpointer(_cfg(root, {"url": memory_remote, "keep_last": 1})) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(float(step)), step=step).wait_uploaded()
        rs = ckpt.remote_storage
        assert rs.listdir(rs.url) == ["step-000000003"]
        assert _listed(root) == ["step-000000001", "step-000000002", "step-000000003"]
        assert [i.step for i in ckpt.list()] == [1, 2, 3]


# ---- 5. close() and delete() ---------------------------------------------------------------------

def test_close_flushes_pending_uploads(tmp_path, memory_remote) -> None:
    gated = GatedStorage(open_storage(memory_remote))
    before = {t.name for t in threading.enumerate()}
    ckpt = Checkpointer(_cfg(tmp_path, {"url": memory_remote}), remote_storage=gated)
    committer = next(t for t in threading.enumerate() if t.name not in before and t.name.startswith("fastckpt-commit"))
    h = ckpt.save(_state(1.0), step=1)
    h.wait()
    assert gated.entered.wait(10) and not h.uploaded()

    def open_gate_once_close_runs() -> None:
        committer.join()  # close() stops the committer before it flushes the uploads
        gated.gate.set()

    opener = threading.Thread(target=open_gate_once_close_runs, name="test-gate-opener")
    opener.start()
    ckpt.close()
    opener.join()
    assert h.uploaded() and h.wait_uploaded().path == _remote_dir(gated, "step-000000001")
    _assert_same_copy(tmp_path, gated, "step-000000001")
    assert _upload_threads() & ({t.name for t in threading.enumerate()} - before) == set()


def test_delete_removes_both_copies_behind_pending_uploads(tmp_path, memory_remote) -> None:
    gated = GatedStorage(open_storage(memory_remote))
    gated.gate.set()
    with Checkpointer(_cfg(tmp_path, {"url": memory_remote}), remote_storage=gated) as ckpt:
        ckpt.save(_state(1.0), step=1).wait_uploaded()
        fut = ckpt.delete("step-000000001")
        assert fut.result(30) is None
        assert not (tmp_path / "step-000000001").exists()
        assert not gated.exists(gated.join(_remote_dir(gated, "step-000000001"), "manifest.json"))
        assert not ckpt.exists("step-000000001") and ckpt.list() == []

        gated.gate.clear()
        gated.entered.clear()
        h = ckpt.save(_state(2.0), step=2)
        h.wait()
        assert gated.entered.wait(10)
        fut = ckpt.delete("step-000000002")  # queued behind the held upload
        assert not fut.done()
        gated.gate.set()
        assert h.wait_uploaded().step == 2  # the upload finished first ...
        fut.result(30)  # ... then both copies went
        assert not ckpt.exists("step-000000002") and ckpt.latest() is None
        assert gated.listdir(gated.url) == []


def test_resaving_a_name_uploads_the_newest_copy(tmp_path, memory_remote) -> None:
    gated = GatedStorage(open_storage(memory_remote))
    with Checkpointer(_cfg(tmp_path, {"url": memory_remote}), remote_storage=gated) as ckpt:
        first = ckpt.save(_state(1.0), step=1, name="last")
        first.wait()
        assert gated.entered.wait(10)
        for step in (2, 3):  # replaced locally while the first upload is held
            ckpt.save(_state(float(step)), step=step, name="last").wait()
        gated.gate.set()
        ckpt.wait()
        assert first.uploaded()
        _assert_same_copy(tmp_path, gated, "last")  # the newest bytes, no stale files left
    with Checkpointer(_cfg(tmp_path / "fresh", {"url": memory_remote})) as other:
        assert_bit_equal(_state(3.0), other.load(name="last"))


# ---- distributed: rank 0 uploads ------------------------------------------------------------------

def _ranks_upload(rank: int, world: int, root: str, url: str, options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = CheckpointConfig(root=root, persist={"chunk_bytes": 4096}, remote={"url": url, "storage_options": options})
    with Checkpointer(cfg, distributed=True) as ckpt:
        ckpt.watch(opt)  # watched tensors are spread over both ranks
        info = ckpt.save(model.state_dict(), step=7).wait_uploaded()
        assert info.path.startswith(url) if rank == 0 else info.path.startswith(root)


@pytest.mark.slow
@pytest.mark.s3
def test_distributed_rank0_uploads_every_ranks_files(tmp_path, s3_root) -> None:
    from tests.dist_launcher import run_ranks

    root = tmp_path / "local"
    run_ranks(_ranks_upload, 2, str(root), s3_root.url, s3_root.storage_options)
    shutil.rmtree(root)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(8)])
    remote = {"url": s3_root.url, "storage_options": s3_root.storage_options}
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "fresh"), remote=remote)) as ckpt:
        assert_bit_equal(model.state_dict(), ckpt.load(step=7))


# ---- 9. uploads a dead process never finished -----------------------------------------------------

_CHILD = textwrap.dedent("""
    import sys, torch
    from fastckpt import CheckpointConfig, Checkpointer
    from fastckpt.storage.local import LocalStorage
    from tests.helpers import GatedStorage
    from tests.test_remote_tier import _state
    root, remote_dir = sys.argv[1], sys.argv[2]
    hung = GatedStorage(LocalStorage(remote_dir))  # the network hangs: no upload ever finishes
    ck = Checkpointer(CheckpointConfig(root=root, persist={"chunk_bytes": 65536}), remote_storage=hung)
    for step in (1, 2):
        ck.save(_state(float(step)), step=step).wait()
    hung.entered.wait()
    print("COMMITTED", flush=True)
    sys.stdin.read()  # until killed
""")


def test_uploads_left_by_a_killed_process_resume_in_the_next_one(tmp_path) -> None:
    root, remote_dir = tmp_path / "local", tmp_path / "remote"
    remote_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(root), str(remote_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout.readline().strip() == "COMMITTED"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    remote = LocalStorage(str(remote_dir))
    assert not list(remote_dir.rglob("manifest.json"))  # nothing reached the remote tier
    cfg = CheckpointConfig(root=str(root), persist={"chunk_bytes": 65536})
    with Checkpointer(cfg, remote_storage=remote) as ckpt:
        assert [h.step for h in ckpt.resumed_uploads] == [1, 2]
        for h in ckpt.resumed_uploads:
            assert h.wait_uploaded().path == _remote_dir(remote, h.name)
            _assert_same_copy(root, remote, h.name)
    shutil.rmtree(root)  # the machine is lost: the remote copies are complete
    with Checkpointer(cfg, remote_storage=remote) as ckpt:
        assert ckpt.resumed_uploads == [] and ckpt.latest() == 2
        assert_bit_equal(_state(2.0), ckpt.load())


def test_only_checkpoints_newer_than_the_remote_ones_are_resumed(tmp_path, memory_remote) -> None:
    cfg = _cfg(tmp_path, {"url": memory_remote, "keep_last": 1})
    with Checkpointer(cfg) as ckpt:
        for step in (1, 2):
            ckpt.save(_state(float(step)), step=step)
        ckpt.wait()
    faulty = FaultyStorage(open_storage(memory_remote), fail_on=1)
    with Checkpointer(cfg, remote_storage=faulty) as ckpt:  # step 3 commits locally, its upload fails
        ckpt.save(_state(3.0), step=3).wait()
        with pytest.raises(StorageError, match="step-000000003"):
            ckpt.wait()
    faulty.fail_on = 1  # the resumed upload fails too: raised at the next wait, once
    faulty.writes = 0
    with Checkpointer(cfg, remote_storage=faulty) as ckpt:
        # step 1 was pruned remotely by keep_last, not lost: only step 3 is newer than the remote's step 2
        assert [h.step for h in ckpt.resumed_uploads] == [3]
        with pytest.raises(StorageError, match="step-000000003"):
            ckpt.wait()
        ckpt.wait()
    with Checkpointer(cfg) as ckpt:
        assert [h.step for h in ckpt.resumed_uploads] == [3]
        ckpt.wait()
    with Checkpointer(CheckpointConfig(root=memory_remote)) as remote_only:
        assert [i.name for i in remote_only.list()] == ["step-000000003"]  # keep_last=1 there
