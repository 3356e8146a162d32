"""Shared fixtures. S3 tests run against a real SeaweedFS server (see `s3server.py`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.faultproxy import FaultProxy
from tests.s3server import S3Server, fail_fast_storage_options, start_s3_server

_S3_FIXTURES = {"s3_server", "s3_root", "s3_fault_proxy"}
# The session's server once started, so a failed S3 test's report can quote the server's side of the story.
_SERVERS: list[S3Server] = []


def pytest_collection_modifyitems(items):
    """Mark every test that uses the S3 server `s3`, so `-m "not s3"` skips them all."""
    for item in items:
        if _S3_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.s3)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed S3 test's report carries weed's recent warnings and errors: an S3 "InternalError" names
    nothing, while weed's log says why (a full volume set, a failed assign, a refused signature)."""
    report = yield
    if report.failed and _SERVERS and "s3" in item.keywords:
        report.sections.append(("weed log: recent warnings and errors", _SERVERS[0].problems() or "<none>"))
    return report


class S3Root(NamedTuple):
    """A unique, empty `s3://bucket/prefix` for one test, and the options to reach it."""

    url: str
    storage_options: dict


@dataclass
class ProxiedS3:
    """The S3 server seen through a `FaultProxy`; its options fail fast (no botocore retries,
    short timeouts) so a fault shows up in seconds, not minutes."""

    proxy: FaultProxy
    server: S3Server

    @property
    def endpoint_url(self) -> str:
        return self.proxy.endpoint_url

    @property
    def storage_options(self) -> dict:
        return fail_fast_storage_options(self.proxy.endpoint_url)

    def fresh_url(self, prefix: str = "t") -> str:
        return self.server.fresh_url(prefix)


@pytest.fixture(scope="session", autouse=True)
def _compiled_pass_ready():
    """Every test sees the compiled pass (format/fused.py) ready, whatever ran before it in this worker: what a
    user's large state gets by default. Tests of the torch passes turn it off (``passpaths.use``); a failed warm-up
    fails here (numba is one of fastckpt's dependencies)."""
    from fastckpt.format import fused

    assert fused.warm("on").result(timeout=600) is not None, fused.state()


@pytest.fixture(autouse=True)
def _private_read_cache(tmp_path_factory, monkeypatch):
    """Each test (and the processes it starts) keeps read-strategy verdicts in a folder of its own, not in the
    user's cache: no verdict of the machine or of another test decides whether a load probes."""
    from fastckpt.read.strategy import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("fastckpt-cache")))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> S3Server:
    """One SeaweedFS `weed mini` on loopback for the whole session; stopped by pid at the end."""
    server = start_s3_server(tmp_path_factory.mktemp("seaweedfs"))
    _SERVERS.append(server)
    try:
        yield server
    finally:
        _SERVERS.remove(server)
        server.stop()


@pytest.fixture
def s3_root(s3_server, request) -> S3Root:
    prefix = re.sub(r"[^A-Za-z0-9_-]+", "-", request.node.name)[:40].strip("-") or "t"
    return S3Root(s3_server.fresh_url(prefix), s3_server.storage_options)


@pytest.fixture
def s3_fault_proxy(s3_server) -> ProxiedS3:
    """A fault proxy in front of the session's S3 server, in pass-through mode at the start."""
    with FaultProxy(("127.0.0.1", s3_server.port), name="s3-faultproxy") as proxy:
        yield ProxiedS3(proxy, s3_server)


@pytest.fixture
def tmpfs_dir():
    """A fresh folder on a tmpfs (/dev/shm): CUDA page-locks shared-memory staging only there, since Linux refuses
    long-term pins of writable file-backed pages on disk file systems (pytest's tmp_path may be overlayfs)."""
    import shutil
    import tempfile

    from fastckpt.engine.staging import fs_type

    if fs_type("/dev/shm") != "tmpfs":
        pytest.skip("needs /dev/shm on tmpfs: CUDA cannot page-lock shared memory on a disk file system")
    d = tempfile.mkdtemp(prefix="fastckpt-test-", dir="/dev/shm")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)
