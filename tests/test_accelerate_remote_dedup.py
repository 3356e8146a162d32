"""Accelerate with a LOCAL project dir and a remote tier on ``s3://`` never re-sends unchanged bytes: the local
``checkpoint_N/manifest.json`` lists each member's content records (format/bundlededup.py ``upload_records``), and
the remote tier's upload copies the unchanged ranges server-side from the previous uploaded folder (tiers/dedup.py),
against the real SeaweedFS through a proxy that counts every byte the client sends. The uploaded folder is the local
one byte for byte, stock ``load_state`` reads it bit-exact, and a gone source or a killed upload costs bytes or
nothing, never a wrong or orphaned upload."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("s3fs", reason="s3fs is not installed (the S3 tests need it)")
import fastckpt_accelerate
from accelerate_testing import fresh_accelerate  # noqa: F401 (fixture)
from fastckpt.format.contenthash import FIELD
from fastckpt.storage.partplan import MIN_PART
from tests.helpers import run_child, s3_uploads
from tests.test_accelerate_s3_dedup import (KILLED_CHILD, LAYERS, SLACK, STOCK, _adapters, _files, _fs, _markers, _setup,
                                            deleting_source,
                                            _two_saves as s3_two_saves,
                                            _stock_load, _step, uploaded_without_its_source)
from tests.test_s3_dedup import counted  # noqa: F401 - a fixture: bytes the client sends through the proxy

pytestmark = pytest.mark.timeout(180)


def _config(proxied, url: str, **extra) -> dict:
    return {"remote": {"url": url, "storage_options": proxied.storage_options}, **extra}


def _local(tmp_path: Path, name: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (tmp_path / "checkpoints" / name).iterdir()}


def _two_saves(tmp_path, proxied, counter, url, between=None):
    """test_accelerate_s3_dedup's two saves into a local project dir, each waited for until uploaded; returns
    (accelerator, model, checkpointing, bytes sent by the first upload, by the second)."""
    return s3_two_saves(tmp_path, proxied, counter, url, between, config=_config(proxied, url))[:5]


def test_second_upload_sends_only_the_changed_bytes_and_the_remote_folder_is_the_local_one(tmp_path, counted):
    proxied, counter = counted
    url = proxied.fresh_url("accremote")
    acc, model, fast, first, second = _two_saves(tmp_path, proxied, counter, url)
    try:
        stats = fast.checkpointer.upload_checksums.dedup
        fs = _fs(proxied)
        local = _local(tmp_path, "checkpoint_1")
        assert set(local) == STOCK | {"manifest.json"}, sorted(local)  # nothing of ours but the manifest
        got = _files(fs, f"{url}/checkpoint_1")
        assert got == local  # byte-identical, the manifest with its records included
        model_size = len(got["model.safetensors"])
        changed = _adapters(model) + sum(len(d) for n, d in got.items() if n != "model.safetensors")
        assert first > model_size  # the first upload had nothing to copy from
        # each changed region (an adapter, and the small files sent whole) costs at most one 5 MiB part of slack
        assert second <= changed + LAYERS * MIN_PART + SLACK, f"sent {second} of {model_size + changed} bytes"
        assert stats.copied >= model_size - LAYERS * MIN_PART and stats.fell_back == 0
        assert FIELD in json.loads(got["manifest.json"])["files"]["model.safetensors"]
        assert s3_uploads(fs, url) == [] and not _markers(fs, url)  # no upload or marker left
        loaded = _stock_load(tmp_path, got)  # stock load_state of a download of the remote folder
        for key, value in acc.unwrap_model(model).state_dict().items():
            assert torch.equal(loaded[key], value), key
    finally:
        acc.end_training()


def test_without_a_remote_tier_the_local_manifest_lists_no_records(tmp_path):
    """Hashing costs CPU: only a root whose commits are uploaded with dedup pays it."""
    acc, model, opt = _setup(tmp_path)
    fast = fastckpt_accelerate.enable(acc)
    try:
        _step(acc, model, opt)
        acc.save_state()
        fast.wait()
        listed = json.loads(_local(tmp_path, "checkpoint_0")["manifest.json"])["files"]
        assert not any(FIELD in rec for rec in listed.values())
    finally:
        acc.end_training()


@pytest.mark.parametrize("when", ["between-saves", "at-the-first-copy"])
def test_a_deleted_previous_remote_folder_is_sent_and_the_folder_is_right(tmp_path, counted, when):
    """``remote.keep_last`` (or anyone) may delete the older remote folder at any time: before the next upload (it
    sends everything), or right when its first copy reaches the store (what is planned as copies from then on is
    sent). Either way the uploaded folder is the local one."""
    proxied, counter = counted
    url = proxied.fresh_url(f"accremote-{when}")
    fs = _fs(proxied)
    acc, model, fast, _, second = _two_saves(tmp_path, proxied, counter, url, deleting_source(fs, counter, url, when))
    try:
        got = uploaded_without_its_source(fs, url, fast.checkpointer.upload_checksums.dedup, second, when)
        assert got == _local(tmp_path, "checkpoint_1")
        assert s3_uploads(fs, url) == []
        loaded = _stock_load(tmp_path, got)
        for key, value in acc.unwrap_model(model).state_dict().items():
            assert torch.equal(loaded[key], value), key
    finally:
        acc.end_training()




def test_sigkill_mid_upload_keeps_the_previous_remote_folder_and_the_next_start_aborts_the_upload(
        tmp_path, s3_fault_proxy):
    proxied = s3_fault_proxy
    url = proxied.fresh_url("accremote-kill")
    fs = _fs(proxied)
    project = tmp_path / "project"
    done = run_child(KILLED_CHILD, url, repr(proxied.server.storage_options), str(Path(__file__).parent),
                     str(project), str(tmp_path / "saved.pt"), "remote", "second")
    assert done.returncode == -9, done.stderr[-3000:]
    assert len(s3_uploads(fs, url)) == 1  # the killed upload's multipart upload, left behind
    assert not fs.exists(f"{url}/checkpoint_1/manifest.json")
    previous = _files(fs, f"{url}/checkpoint_0")
    assert previous == _local(project, "checkpoint_0")  # the previous remote folder intact
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    acc, model, opt = _setup(project)
    try:  # the next start sweeps what the dead process left, and uploads checkpoint_1, committed locally
        remote = {"url": url, "storage_options": proxied.server.storage_options}
        fast = fastckpt_accelerate.enable(acc, {"remote": remote, "orphan_grace_s": 0})
        acc.load_state()  # the newest checkpoint: checkpoint_1, from the local project dir
        for key, value in saved.items():
            assert torch.equal(acc.unwrap_model(model).state_dict()[key], value), key
        fast.wait()
        assert s3_uploads(fs, url) == [] and not _markers(fs, url)
        got = _files(fs, f"{url}/checkpoint_1")
        assert got == _local(project, "checkpoint_1")
        assert fast.checkpointer.upload_checksums.dedup.copied > 0  # the resumed upload copied from checkpoint_0
        loaded = _stock_load(tmp_path, got)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
    finally:
        acc.end_training()
