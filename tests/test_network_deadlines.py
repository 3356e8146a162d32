"""A stalled network or disk never hangs training: request deadlines, retries, and bounded wait/close.

The S3 cases blackhole the fault proxy (connections accepted, never answered) while botocore is
told to wait an hour: only fastckpt's own deadline can end the request.
"""
from __future__ import annotations

import errno
import socket
import threading
import time
from typing import Any, Callable

import fsspec.implementations.memory
import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, CheckpointTimeoutError, StorageError
from fastckpt.storage.fsspec import FsspecStorage
from fastckpt.storage.local import LocalStorage
from tests.helpers import GatedStorage, StillBlocked, assert_bit_equal, bounded
from tests.s3server import s3_storage_options

_PATIENT_BOTOCORE = {"connect_timeout": 3600, "read_timeout": 3600}  # alone, it would wait an hour
# A stalled save sits through each of its requests' deadline twice (one retry), for three requests in turn (the
# previous manifest read for dedup, the PUT, the partial files' removal): 1.5 s keeps that under 10 s, and still
# leaves a healthy loopback request (milliseconds; a 4 MiB PUT under a tenth of a second) room on a loaded host.
_FAST = {"timeout_s": 1.5, "retries": 1, "backoff_s": 0.1}


def _state(v: float) -> dict:
    return {"w": torch.full((1024, 1024), v), "b": torch.arange(1000, dtype=torch.int64) * int(v), "step": int(v)}


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result or exception, or fail the test if it is still blocked after ``seconds``."""
    try:
        return bounded(fn, seconds)
    except StillBlocked:
        pytest.fail(f"still blocked after {seconds}s")


def _patient(proxy) -> dict:
    return s3_storage_options(proxy.endpoint_url, **_PATIENT_BOTOCORE)


# ---- an s3:// root ------------------------------------------------------------------------------

@pytest.mark.s3
def test_stalled_s3_root_fails_the_blocked_save_at_the_deadline(s3_fault_proxy) -> None:
    proxy = s3_fault_proxy.proxy
    cfg = CheckpointConfig(root=s3_fault_proxy.fresh_url("stall"), storage_options=_patient(proxy),
                           persist={"chunk_bytes": 2 << 20}, staging={"slots": 1}, network=_FAST)
    ckpt = Checkpointer(cfg)
    ckpt.save(_state(1.0), step=1).wait()
    proxy.stall()  # a silent partition: even the pooled connections stop answering
    h2 = ckpt.save(_state(2.0), step=2)  # its upload stalls and holds the only slot
    t0 = time.monotonic()
    with pytest.raises(CheckpointTimeoutError) as ei:
        _within(60, lambda: ckpt.save(_state(3.0), step=3))  # blocked on the slot, then told why
    assert time.monotonic() - t0 < 30
    assert "step-000000002" in str(ei.value) and "network.timeout_s" in str(ei.value)
    assert isinstance(ei.value, StorageError)
    with pytest.raises(CheckpointTimeoutError):
        h2.wait(0)  # the handle still reports its own failure
    proxy.pass_through()
    ckpt.wait()  # raised once already
    assert ckpt.latest() == 1
    assert_bit_equal(_state(1.0), ckpt.load())
    ckpt.save(_state(3.0), step=3).wait()  # the network is back
    assert [i.step for i in ckpt.list()] == [1, 3]
    ckpt.close()


@pytest.mark.s3
def test_stalled_s3_root_when_busy_skip_never_blocks(s3_fault_proxy) -> None:
    proxy = s3_fault_proxy.proxy
    cfg = CheckpointConfig(root=s3_fault_proxy.fresh_url("skip"), storage_options=_patient(proxy),
                           staging={"slots": 1, "when_busy": "skip"}, network=_FAST)
    ckpt = Checkpointer(cfg)
    ckpt.save(_state(1.0), step=1).wait()
    proxy.blackhole()
    ckpt.save(_state(2.0), step=2)
    assert _within(10, lambda: ckpt.save(_state(3.0), step=3)).skipped  # obeys when_busy at once
    with pytest.raises(CheckpointTimeoutError, match="step-000000002"):
        _within(60, ckpt.wait)  # the stalled save fails at its deadline
    proxy.pass_through()
    ckpt.close()
    with Checkpointer(cfg) as again:
        assert again.latest() == 1


@pytest.mark.s3
def test_close_timeout_is_honoured_while_an_s3_root_stalls(s3_fault_proxy) -> None:
    proxy = s3_fault_proxy.proxy
    cfg = CheckpointConfig(root=s3_fault_proxy.fresh_url("close"), storage_options=_patient(proxy),
                           network={"timeout_s": 120, "retries": 0})  # longer than the test: close must not wait
    ckpt = Checkpointer(cfg)
    ckpt.save(_state(1.0), step=1).wait()
    proxy.stall()
    h = ckpt.save(_state(2.0), step=2)
    t0 = time.monotonic()
    with pytest.raises(CheckpointTimeoutError, match="save 'step-000000002'"):
        _within(30, lambda: ckpt.close(timeout=1))
    assert time.monotonic() - t0 < 10
    ckpt.close()  # idempotent
    proxy.pass_through()  # the held bytes flow again: the stalled write commits, or fails and is retried
    try:
        committed = h.wait(60) is not None
    except StorageError:
        committed = False
    with Checkpointer(cfg) as again:
        assert again.latest() == (2 if committed else 1)
        assert_bit_equal(_state(1.0), again.load(step=1))  # the previous checkpoint is intact either way
        assert_bit_equal(_state(float(again.latest())), again.load())


# ---- a local root with remote.url on S3 -----------------------------------------------------------

@pytest.mark.s3
def test_stalled_remote_tier_fails_the_upload_at_the_deadline(tmp_path, s3_fault_proxy) -> None:
    proxy = s3_fault_proxy.proxy
    url = s3_fault_proxy.fresh_url("remote-stall")
    cfg = CheckpointConfig(root=str(tmp_path / "local"), remote={"url": url, "storage_options": _patient(proxy)},
                           network=_FAST)
    ckpt = Checkpointer(cfg)
    ckpt.save(_state(1.0), step=1).wait_uploaded()
    proxy.stall()
    h = ckpt.save(_state(2.0), step=2)
    assert _within(30, h.wait).step == 2  # the local commit does not wait for the network
    t0 = time.monotonic()
    with pytest.raises(CheckpointTimeoutError) as ei:
        _within(60, ckpt.wait)
    assert time.monotonic() - t0 < 30
    assert f"{url}/step-000000002" in str(ei.value) and "Checkpointer.upload('step-000000002')" in str(ei.value)
    _within(10, ckpt.wait)  # raised once
    proxy.pass_through()
    assert_bit_equal(_state(2.0), ckpt.load(step=2))  # the local copy
    ckpt.upload("step-000000002").result(60)
    ckpt.close()
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "fresh"), remote=cfg.remote)) as other:
        assert [i.step for i in other.list()] == [1, 2]
        assert_bit_equal(_state(2.0), other.load(step=2))


@pytest.mark.s3
def test_close_timeout_is_honoured_while_the_remote_tier_stalls(tmp_path, s3_fault_proxy) -> None:
    proxy = s3_fault_proxy.proxy
    url = s3_fault_proxy.fresh_url("remote-close")
    cfg = CheckpointConfig(root=str(tmp_path / "local"), remote={"url": url, "storage_options": _patient(proxy)},
                           network={"timeout_s": 120, "retries": 0})
    ckpt = Checkpointer(cfg)
    proxy.blackhole()
    ckpt.save(_state(1.0), step=1).wait()
    with pytest.raises(CheckpointTimeoutError, match="step-000000001"):
        _within(30, lambda: ckpt.close(timeout=1))
    proxy.pass_through()
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "local"))) as local_only:
        assert_bit_equal(_state(1.0), local_only.load())


# ---- a local root: wait/close(timeout) on a stalled disk -------------------------------------------

def test_wait_timeout_names_the_pending_local_save(tmp_path) -> None:
    gated = GatedStorage(LocalStorage(str(tmp_path)))
    ckpt = Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=gated)
    h = ckpt.save(_state(1.0), step=1)
    assert gated.entered.wait(10)
    with pytest.raises(CheckpointTimeoutError, match=r"wait\(timeout=0.2\).*save 'step-000000001'"):
        ckpt.wait(timeout=0.2)
    gated.gate.set()
    ckpt.wait()
    assert h.wait().step == 1
    assert_bit_equal(_state(1.0), ckpt.load())
    ckpt.close()


def test_close_timeout_is_honoured_while_a_local_write_stalls(tmp_path) -> None:
    gated = GatedStorage(LocalStorage(str(tmp_path)))
    ckpt = Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=gated)
    h = ckpt.save(_state(1.0), step=1)
    assert gated.entered.wait(10)
    with pytest.raises(CheckpointTimeoutError, match="save 'step-000000001'"):
        _within(20, lambda: ckpt.close(timeout=0.2))
    gated.gate.set()  # the disk comes back: the save still commits in the background
    assert h.wait(30).step == 1
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as again:
        assert_bit_equal(_state(1.0), again.load())


# ---- the storage layer: deadlines and retries on a blocking backend --------------------------------

class _Flaky(fsspec.implementations.memory.MemoryFileSystem):
    """memory:// whose reads first fail ``fails`` times with ``err``, or hang until ``release`` is set."""

    cachable = False
    protocol = ("flaky",)

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.fails: list[BaseException] = []
        self.calls = 0
        self.opens = 0
        self.release: threading.Event | None = None

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> Any:
        if "w" in mode:
            self.opens += 1
            if self.release is not None:
                self.release.wait(60)
        return super()._open(path, mode, **kw)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kw: Any) -> bytes:
        self.calls += 1
        if self.release is not None:
            self.release.wait(60)
        if self.fails:
            raise self.fails.pop(0)
        return super().cat_file(path, start, end, **kw)


def _flaky_storage(**network: Any) -> tuple[FsspecStorage, _Flaky]:
    from fastckpt.config import NetworkOptions

    st = FsspecStorage("memory://net-flaky", {}, network=NetworkOptions(**network))
    fs = _Flaky()
    st.fs = fs
    fs.pipe_file("/net-flaky/a", b"abc")
    return st, fs


def test_transient_errors_are_retried_then_raised() -> None:
    st, fs = _flaky_storage(timeout_s=5, retries=2, backoff_s=0.01)
    fs.fails = [ConnectionResetError(errno.ECONNRESET, "reset"), TimeoutError("slow")]
    assert st.read_bytes("memory://net-flaky/a") == b"abc" and fs.calls == 3
    fs.calls, fs.fails = 0, [ConnectionResetError(errno.ECONNRESET, "reset")] * 3
    with pytest.raises(StorageError, match="net-flaky/a"):
        st.read_bytes("memory://net-flaky/a")
    assert fs.calls == 3  # 1 + retries, no more
    fs.calls, fs.fails = 0, [PermissionError(errno.EACCES, "denied")]
    with pytest.raises(StorageError):
        st.read_bytes("memory://net-flaky/a")
    assert fs.calls == 1  # not transient: not retried


def test_a_hung_blocking_backend_is_abandoned_at_the_deadline() -> None:
    st, fs = _flaky_storage(timeout_s=0.3, retries=1, backoff_s=0.01)
    fs.release = threading.Event()
    try:
        with pytest.raises(CheckpointTimeoutError, match="0.3s deadline"):
            _within(10, lambda: st.read_bytes("memory://net-flaky/a"))
        assert fs.calls == 2
    finally:
        fs.release.set()  # lets the abandoned helper threads end


def test_a_hung_streamed_write_is_not_retried_while_it_may_still_run() -> None:
    st, fs = _flaky_storage(timeout_s=0.3, retries=2, backoff_s=0.01)
    fs.release, fs.opens = threading.Event(), 0
    try:
        with pytest.raises(CheckpointTimeoutError, match="net-flaky/b"):
            _within(10, lambda: st.write_file("memory://net-flaky/b", [memoryview(b"xyz")]))
        assert fs.opens == 1  # a retry would race the abandoned writer, which still reads the caller's buffer
    finally:
        fs.release.set()


# ---- the fault proxy's silent partition -----------------------------------------------------------

def _response(sock: socket.socket) -> bytes:
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(4096)
        assert chunk, "connection closed"
        got += chunk
    return got


@pytest.mark.s3
def test_stall_freezes_an_open_connection_silently_then_heals(s3_fault_proxy) -> None:
    proxy = s3_fault_proxy.proxy
    request = b"HEAD / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"  # keep-alive: the same connection twice
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
        sock.sendall(request)
        assert _response(sock).startswith(b"HTTP/1.1")
        proxy.stall()
        sock.sendall(request)
        sock.settimeout(0.3)  # proving a negative needs some window; kept short
        with pytest.raises(TimeoutError):
            sock.recv(64)  # no answer, and no reset either
        proxy.pass_through()
        sock.settimeout(5)
        assert _response(sock).startswith(b"HTTP/1.1")  # the held request went through intact
