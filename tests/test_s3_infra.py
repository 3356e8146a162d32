"""The test infrastructure itself: the real SeaweedFS server, s3fs against it, the fault proxy."""

from __future__ import annotations

import os
import socket
import threading

import pytest

# the GPU machine has no s3fs (benchmarks/gpu.sh): skipped there, with the reason, not a collection error
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed (the S3 tests need it)")
from botocore.exceptions import BotoCoreError  # noqa: E402 - s3fs brings botocore

from tests import s3server
from tests.faultproxy import FaultProxy, Mode

MiB = 1 << 20
# What a broken network looks like through s3fs: botocore's connection errors, or OSError.
NETWORK_ERRORS = (BotoCoreError, OSError)


def _fs(storage_options: dict) -> s3fs.S3FileSystem:
    # No instance cache: a cached instance would keep its listings and pooled connections
    # across tests (and across proxies that reuse a port).
    return s3fs.S3FileSystem(skip_instance_cache=True, **storage_options)


# -- the server --------------------------------------------------------------------------------


def test_bucket_exists_and_urls_are_fresh(s3_server):
    fs = _fs(s3_server.storage_options)
    assert fs.exists(s3_server.bucket)
    a, b = s3_server.fresh_url("run"), s3_server.fresh_url("run")
    assert a != b and a.startswith(f"s3://{s3_server.bucket}/run-")
    assert s3_server.endpoint_url.startswith("http://127.0.0.1:")
    assert s3_server.process.poll() is None


def test_the_volume_count_is_fixed_not_sized_from_the_free_disk(s3_server):
    """weed mini's own default (free disk / volume size at startup) gave a CI machine with a few GB free about five
    volumes; the suite's objects filled them and later writes failed with InternalError. The master must report the
    fixed count, whatever this disk holds."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{s3_server.master_port}/dir/status", timeout=5) as r:
        topology = json.load(r)["Topology"]
    assert topology["Max"] == s3server.MAX_VOLUMES, topology


def test_a_failed_s3_tests_report_quotes_weeds_errors_not_its_chatter(tmp_path):
    log = tmp_path / "weed.log"
    log.write_text(
        "I1130 03:22:36.1 master_grpc_server_assign.go:227 assign count:1\n"
        "W1130 03:22:36.2 worker.go:180 Plugin worker stream ended: connection refused\n"
        "W1130 03:22:36.3 client.go:379 [session e6f5] Reconnection attempt 50 failed\n"
        "E1130 03:22:36.4 upload_chunked.go:281 chunked upload failed: No writable volumes and no free volumes left\n"
        "╔════ a banner line ═══╗\n"
        "E\n")
    server = s3server.S3Server(endpoint_url="http://127.0.0.1:1", bucket="b", log_path=log, process=None)
    assert server.problems().splitlines() == [
        "E1130 03:22:36.4 upload_chunked.go:281 chunked upload failed: No writable volumes and no free volumes left"]
    assert server.problems(lines=0) == ""
    assert s3server.S3Server("http://127.0.0.1:1", "b", tmp_path / "missing.log", None).problems().startswith(
        "<no log:")


def test_put_get_ls_roundtrip(s3_root):
    fs = _fs(s3_root.storage_options)
    fs.pipe(f"{s3_root.url}/ckpt/a.bin", b"alpha")
    fs.pipe(f"{s3_root.url}/ckpt/b.bin", b"beta")
    assert fs.cat(f"{s3_root.url}/ckpt/a.bin") == b"alpha"
    assert fs.cat_file(f"{s3_root.url}/ckpt/b.bin", start=1, end=3) == b"et"
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{s3_root.url}/ckpt")) == ["a.bin",
                                                                                 "b.bin"]
    assert fs.info(f"{s3_root.url}/ckpt/b.bin")["size"] == 4
    assert fs.isdir(f"{s3_root.url}/ckpt")
    assert not fs.exists(f"{s3_root.url}/ckpt/missing.bin")


@pytest.mark.parametrize("how", ["stream", "put_file"])
def test_multipart_upload(s3_root, tmp_path, how):
    data = os.urandom(11 * MiB)  # 3 parts of 5 + 5 + 1 MiB (5 MiB is S3's minimum part)
    url = f"{s3_root.url}/big.bin"
    fs = _fs(s3_root.storage_options)
    if how == "stream":
        # s3fs sends one part per flush of `block_size` bytes; a single 11 MiB write() would
        # go out as one big part, so write in pieces like a real producer does.
        with fs.open(url, "wb", block_size=5 * MiB) as f:
            for start in range(0, len(data), MiB):
                f.write(data[start:start + MiB])
    else:
        local = tmp_path / "big.bin"
        local.write_bytes(data)
        fs.put_file(str(local), url, chunksize=5 * MiB)
    assert fs.info(url)["ETag"].strip('"').endswith("-3")  # proof that it was multipart
    assert fs.cat(url) == data


def test_missing_weed_fails_with_install_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"pip install -e \"\.\[test\]\""):
        s3server.start_s3_server(tmp_path / "data")


# -- the fault proxy ---------------------------------------------------------------------------


def test_proxy_passes_through(s3_fault_proxy):
    url = s3_fault_proxy.fresh_url("proxy")
    fs = _fs(s3_fault_proxy.storage_options)
    fs.pipe(f"{url}/x", b"through the proxy")
    assert fs.cat(f"{url}/x") == b"through the proxy"
    assert s3_fault_proxy.proxy.accepted >= 1
    assert s3_fault_proxy.proxy.bytes_up > len(b"through the proxy")


def test_refuse_makes_the_bucket_unreachable_then_recovers(s3_fault_proxy):
    url = f"{s3_fault_proxy.fresh_url('refuse')}/x"
    fs = _fs(s3_fault_proxy.storage_options)
    fs.pipe(url, b"1")  # leaves a pooled keep-alive connection that refuse() must reset too
    s3_fault_proxy.proxy.refuse()
    with pytest.raises(NETWORK_ERRORS):
        fs.cat(url)
    with pytest.raises(NETWORK_ERRORS):
        fs.pipe(url, b"2")
    s3_fault_proxy.proxy.pass_through()
    assert fs.cat(url) == b"1"


def test_cut_mid_upload_fails_and_leaves_nothing(s3_fault_proxy, s3_server):
    url = f"{s3_fault_proxy.fresh_url('cut')}/x"
    proxy = s3_fault_proxy.proxy
    proxy.cut_upload_after(256 * 1024)
    with pytest.raises(NETWORK_ERRORS):
        _fs(s3_fault_proxy.storage_options).pipe(url, os.urandom(MiB))
    assert proxy.cut.is_set() and proxy.mode is Mode.REFUSE
    assert not _fs(s3_server.storage_options).exists(url)


def test_cut_mid_multipart_upload_fails(s3_fault_proxy, s3_server):
    url = f"{s3_fault_proxy.fresh_url('cutmp')}/x"
    fs = _fs(s3_fault_proxy.storage_options)
    s3_fault_proxy.proxy.cut_upload_after(7 * MiB)  # inside the second 5 MiB part
    with pytest.raises(NETWORK_ERRORS):
        with fs.open(url, "wb", block_size=5 * MiB) as f:
            for _ in range(11):
                f.write(os.urandom(MiB))
    assert s3_fault_proxy.proxy.cut.is_set()
    assert not _fs(s3_server.storage_options).exists(url)


def test_transient_cut_is_survived_by_a_retry(s3_fault_proxy, s3_server):
    url = f"{s3_fault_proxy.fresh_url('blip')}/x"
    data = os.urandom(MiB)
    s3_fault_proxy.proxy.cut_upload_after(256 * 1024, then=Mode.PASS)
    _fs(s3_fault_proxy.storage_options).pipe(url, data)  # s3fs retries on the reset
    assert s3_fault_proxy.proxy.cut.is_set()
    assert _fs(s3_server.storage_options).cat(url) == data


def test_blackhole_accepts_but_never_answers(s3_fault_proxy):
    proxy = s3_fault_proxy.proxy
    request = b"HEAD / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(request)
        assert sock.recv(64).startswith(b"HTTP/1.1")  # pass-through answers
    proxy.blackhole()
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(request)
        sock.settimeout(0.3)  # proving a negative needs some window; kept short
        with pytest.raises(TimeoutError):
            sock.recv(64)
        proxy.pass_through()  # resets the held connection synchronously
        sock.settimeout(5)
        with pytest.raises(ConnectionResetError):
            sock.recv(64)


def test_proxy_close_stops_its_threads(s3_server):
    proxy = FaultProxy(("127.0.0.1", s3_server.port), name="closetest").start()
    fs = _fs(s3server.s3_storage_options(proxy.endpoint_url))
    fs.pipe(f"{s3_server.fresh_url('close')}/x", b"1")  # leaves live pump threads
    assert any(t.name.startswith("closetest-") for t in threading.enumerate())
    proxy.close()
    proxy.close()  # idempotent
    assert not [t.name for t in threading.enumerate() if t.name.startswith("closetest-")]
