"""Network failures against the real S3 server, injected by a TCP fault proxy."""
from __future__ import annotations

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, StorageError
from tests.helpers import assert_bit_equal


# After a cut (or with refuse()) the proxy refuses every connection: each request a failed save sends (the parts,
# the abort, the marker's and partial files' removal) fails its attempts at once, and only the backoff between them
# (1 s, then 2 s by default) is waited. Still retried as often, just not slept through.
_QUICK_RETRIES = {"backoff_s": 0.05}


def _state(v: float) -> dict:
    return {"w": torch.full((1024, 1024), v), "step": int(v)}  # 4 MiB


def test_unreachable_bucket_names_the_url(s3_fault_proxy) -> None:
    url = s3_fault_proxy.fresh_url("unreachable")
    s3_fault_proxy.proxy.refuse()
    cfg = CheckpointConfig(root=url, storage_options=s3_fault_proxy.storage_options, network=_QUICK_RETRIES)
    with pytest.raises(StorageError) as ei:
        with Checkpointer(cfg) as ckpt:
            ckpt.save(_state(1.0), step=1).wait()
    assert url.removeprefix("s3://").split("/")[0] in str(ei.value)


def test_upload_cut_mid_file_keeps_previous_checkpoint(s3_fault_proxy) -> None:
    url = s3_fault_proxy.fresh_url("cut")
    cfg = CheckpointConfig(root=url, storage_options=s3_fault_proxy.storage_options,
                           persist={"chunk_bytes": 2 << 20, "workers": 1}, network=_QUICK_RETRIES)
    with Checkpointer(cfg) as ckpt:
        ckpt.save(_state(1.0), step=1).wait()
        s3_fault_proxy.proxy.cut_upload_after(1 << 20)  # the connection dies 1 MiB into the next upload
        h = ckpt.save(_state(2.0), step=2)
        with pytest.raises(StorageError) as ei:
            h.wait()
        assert "step-000000002" in str(ei.value)
        s3_fault_proxy.proxy.pass_through()
        ckpt.wait()  # already reported through the handle: not raised again
        assert ckpt.latest() == 1
        assert_bit_equal(_state(1.0), ckpt.load())
        ckpt.save(_state(3.0), step=3).wait()  # the pipeline recovers once the network does
        assert [i.step for i in ckpt.list()] == [1, 3]


def test_large_file_goes_up_as_concurrent_multipart(s3_server) -> None:
    """A shard above two parts is one multipart upload; its bytes and checksum survive."""
    import fsspec

    url = s3_server.fresh_url("multipart")
    state = {"big": torch.randn(12 << 20)}  # 48 MiB + the 4 KiB header: three 16 MiB parts and a tail
    cfg = CheckpointConfig(root=url, storage_options=s3_server.storage_options)
    with Checkpointer(cfg) as ckpt:
        ckpt.save(state, step=1).wait()
        assert_bit_equal(state, ckpt.load())
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    shard = next(p for p in fs.ls(url.removeprefix("s3://") + "/step-000000001") if p.endswith(".safetensors"))
    assert fs.info(shard)["ETag"].strip('"').endswith("-4"), "expected a 4-part multipart upload"


def test_multipart_upload_cut_is_aborted_and_reported(s3_fault_proxy) -> None:
    url = s3_fault_proxy.fresh_url("mpcut")
    cfg = CheckpointConfig(root=url, storage_options=s3_fault_proxy.storage_options, network=_QUICK_RETRIES)
    big = {"big": torch.randn(12 << 20)}
    with Checkpointer(cfg) as ckpt:
        ckpt.save(_state(1.0), step=1).wait()
        s3_fault_proxy.proxy.cut_upload_after(20 << 20)  # dies inside the second part
        with pytest.raises(StorageError, match="step-000000002"):
            ckpt.save(big, step=2).wait()
        s3_fault_proxy.proxy.pass_through()
        assert ckpt.latest() == 1
        assert_bit_equal(_state(1.0), ckpt.load())



@pytest.mark.parametrize("retries", [0, 1])
def test_a_refused_request_is_sent_once_per_attempt_of_network_retries(s3_fault_proxy, retries) -> None:
    """botocore's and s3fs's own retries are left to ``network.retries``: each of fastckpt's attempts is one request
    sent by botocore. ``{"max_attempts": 1}`` (botocore's count of *retries*) made each attempt two, the second after
    botocore's own jittered backoff of up to a second, in no log of fastckpt's."""
    from fastckpt.config import NetworkOptions
    from fastckpt.storage.fsspec import FsspecStorage
    from tests.s3server import s3_storage_options

    url = s3_fault_proxy.fresh_url("refused")
    storage = FsspecStorage(url, s3_storage_options(s3_fault_proxy.endpoint_url),  # fastckpt's botocore defaults
                            network=NetworkOptions(timeout_s=10, retries=retries, backoff_s=0))
    storage.fs.connect()  # s3fs's botocore client, to count what it sends
    sent: list[str] = []
    storage.fs.s3.meta.events.register("before-send.s3", lambda request, **_: sent.append(request.method))
    s3_fault_proxy.proxy.refuse()
    with pytest.raises(StorageError, match=url.removeprefix("s3://")):
        storage.read_bytes(f"{url}/manifest.json")
    assert sent == ["HEAD"] * (retries + 1)  # s3fs's cat_file asks for the size first: the request that fails
