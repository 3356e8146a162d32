"""The store verifies every byte: CRC32C on every PUT and part, against the real S3 server (SeaweedFS).

Damage in flight and a store that ignores the checksum headers are made by the fault proxy
(tests/faultproxy.py) rewriting the bytes between the client and the real server.
"""
from __future__ import annotations

import re
import threading
from pathlib import Path

import fsspec
import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.format.checksum import crc32c
from fastckpt.read.verify import verify_checkpoint
from fastckpt.storage.protocol import open_storage
from fastckpt.storage.s3checksum import PART_BYTES, b64, composite, expected_like, part_bytes
from tests.helpers import assert_bit_equal

_PART = 16 << 20


class FlipOnce:
    """Flips one bit of the upload stream at byte ``at`` (all connections together), once."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen = 0
        self.flipped = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, data: bytes, upload: bool) -> bytes:
        if not upload:
            return data
        with self._lock:
            start, self.seen = self.seen, self.seen + len(data)
            if self.flipped.is_set() or not start <= self.at < self.seen:
                return data
            self.flipped.set()
        i = self.at - start
        return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]


_HEADER = re.compile(rb"x-amz-(sdk-)?checksum-", re.IGNORECASE)
_XML = re.compile(rb"<(ChecksumCRC32C|ChecksumType|ChecksumAlgorithm)>[^<]*</\1>")


def strip_checksums(data: bytes, upload: bool) -> bytes:
    """A store that knows no checksums: the checksum headers (both ways) and XML elements become unknown ones
    of the same length (so Content-Length stays right); the server neither checks nor returns them."""
    data = _HEADER.sub(lambda m: b"x-zzz-" + (b"zzz-" if m.group(1) else b"") + b"checksum-", data)
    return _XML.sub(lambda m: b" " * len(m.group(0)), data)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(10 << 20, generator=g), "small": torch.randn(1000, generator=g), "step": seed}


def _remote_files(fs, url: str) -> dict[str, bytes]:
    base = url.removeprefix("s3://")
    return {p.rsplit("/", 1)[-1]: fs.cat_file(p) for p in fs.find(base)}


def _local_files(root: Path, name: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (root / name).iterdir() if p.is_file()}


def test_part_damaged_in_flight_is_rejected_and_sent_again(tmp_path, s3_fault_proxy) -> None:
    url = s3_fault_proxy.fresh_url("damaged")
    remote = {"url": url, "storage_options": s3_fault_proxy.storage_options, "workers": 1}
    flip = FlipOnce(_PART + (3 << 20))  # 19 MiB in: inside a part's body (a request's headers are ~1 KB)
    state = _state(1)
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "local"), remote=remote, staging={"mode": "eager"})) as ckpt:
        s3_fault_proxy.proxy.rewrite = flip
        ckpt.save(state, step=1).wait()
        ckpt.wait()  # the upload too
        s3_fault_proxy.proxy.rewrite = None
        assert flip.flipped.is_set()
        stats = ckpt.upload_checksums
        assert stats is not None and stats.resent == 1 and stats.ignored == 0
        local = _local_files(tmp_path / "local", "step-000000001")
        fs = fsspec.filesystem("s3", **s3_fault_proxy.server.storage_options)
        got = _remote_files(fs, f"{url}/step-000000001")
        assert got == local  # bit-exact: the damaged part never made it into the object
        listed = {n: d for n, d in local.items() if n != "manifest.json"}  # the manifest: a checked PUT, not counted
        assert stats.verified == len(listed) == 2
        for name, data in listed.items():
            path = f"{url}/step-000000001/{name}"
            recorded = stats.objects[path]
            # the server's checksum is the manifest's CRC32C (a PUT) or the composite of the parts' CRC32Cs
            want = (b64(crc32c(data)) if len(data) <= 2 * _PART else
                    composite([crc32c(data[i:i + _PART]) for i in range(0, len(data), _PART)]))
            assert recorded == want == expected_like(data, recorded)
            head = fs.info(path.removeprefix("s3://"))
            assert head["size"] == len(data)
        assert any(v.endswith("-3") for v in stats.objects.values())  # the shard went up as 3 parts
        assert_bit_equal(state, ckpt.load(1))


def test_store_that_ignores_checksums_is_reported_and_upload_goes_on(tmp_path, s3_fault_proxy) -> None:
    url = s3_fault_proxy.fresh_url("nochecksum")
    remote = {"url": url, "storage_options": s3_fault_proxy.storage_options}
    state = _state(2)
    s3_fault_proxy.proxy.rewrite = strip_checksums
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "local"), remote=remote, staging={"mode": "eager"})) as ckpt:
        ckpt.save(state, step=2).wait()
        ckpt.wait()
        stats = ckpt.upload_checksums
        local = _local_files(tmp_path / "local", "step-000000002")
        assert stats is not None and stats.verified == 0 and stats.ignored == len(local) - 1 == 2
        assert not stats.objects
        assert ckpt.remote_storage is not None and ckpt.remote_storage.checksums_ignored == 3  # the manifest too
    s3_fault_proxy.proxy.rewrite = None
    fs = fsspec.filesystem("s3", **s3_fault_proxy.server.storage_options)
    assert _remote_files(fs, f"{url}/step-000000002") == local
    with Checkpointer(CheckpointConfig(root=url, storage_options=s3_fault_proxy.server.storage_options)) as back:
        assert_bit_equal(state, back.load(2))


def test_verify_compares_the_stored_checksum(tmp_path, s3_fault_proxy) -> None:
    url = s3_fault_proxy.fresh_url("verify")
    state = _state(3)
    with Checkpointer(CheckpointConfig(root=url, storage_options=s3_fault_proxy.storage_options,
                                       staging={"mode": "eager"})) as ckpt:
        ckpt.save(state, step=3).wait()
    storage = open_storage(url, s3_fault_proxy.storage_options)
    manifest, problems = verify_checkpoint(storage, f"{url}/step-000000003")
    assert manifest is not None and problems == []

    def lie(data: bytes, upload: bool) -> bytes:  # the store reports another checksum than the bytes give
        if upload:
            return data
        return re.sub(rb"(?i)(x-amz-checksum-crc32c: )[A-Za-z0-9+/]{6}==", rb"\1AAAAAA==", data)

    s3_fault_proxy.proxy.rewrite = lie
    _, problems = verify_checkpoint(storage, f"{url}/step-000000003")
    assert problems and all("the store keeps checksum 'AAAAAA==" in p for p in problems)
    assert len(problems) == len(manifest["files"])


def test_part_size_keeps_every_object_within_10000_parts() -> None:
    """S3 refuses part 10,001: a file over 156 GiB (a Lightning .ckpt) needs bigger parts, in whole MiB."""
    for size in (1, 32 << 20, 156 << 30, 157 << 30, 1 << 40, 5 << 40):
        part = part_bytes(size)
        assert -(-size // part) <= 10_000 and part % (1 << 20) == 0 and (5 << 20) <= part <= (5 << 30)
    assert part_bytes(156 << 30) == PART_BYTES  # every object of today's size keeps today's parts
    data = bytes(range(256)) * (3 * PART_BYTES // 256 + 1)  # a composite over PART_BYTES parts: 4 of them
    want = composite([crc32c(data[i:i + PART_BYTES]) for i in range(0, len(data), PART_BYTES)])
    assert want.endswith("-4") and expected_like(data, want) == want
    assert expected_like(data, want[:-2] + "-5") is None  # parts of another uploader's size: not checkable


def test_put_damaged_in_flight_is_rejected_and_sent_again(tmp_path, s3_fault_proxy) -> None:
    """Files up to 32 MiB are one PUT carrying the manifest's own CRC32C: damage in its body is caught too."""
    url = s3_fault_proxy.fresh_url("damagedput")
    remote = {"url": url, "storage_options": s3_fault_proxy.storage_options, "workers": 1}
    state = {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(4))}  # 4 MiB: one PUT
    flip = FlipOnce(1 << 20)  # past the few request headers before it: inside a body
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "local"), remote=remote, staging={"mode": "eager"})) as ckpt:
        s3_fault_proxy.proxy.rewrite = flip
        ckpt.save(state, step=4).wait()
        ckpt.wait()
        s3_fault_proxy.proxy.rewrite = None
        assert flip.flipped.is_set()
        stats = ckpt.upload_checksums
        assert stats is not None and stats.resent == 1 and stats.verified == 2
        assert not any("-" in v for v in stats.objects.values())  # single PUTs: full-object checksums
    fs = fsspec.filesystem("s3", **s3_fault_proxy.server.storage_options)
    assert _remote_files(fs, f"{url}/step-000000004") == _local_files(tmp_path / "local", "step-000000004")


def test_local_file_changed_after_commit_is_not_uploaded(tmp_path, s3_server) -> None:
    """The PUT carries the manifest's CRC32C, not one of the bytes read: a local file damaged after its commit
    is refused by the store, and the remote copy is never committed."""
    url = s3_server.fresh_url("tampered")
    local = tmp_path / "local"
    state = {"w": torch.randn(1 << 18, generator=torch.Generator().manual_seed(5))}
    with Checkpointer(CheckpointConfig(root=str(local), staging={"mode": "eager"})) as ckpt:
        ckpt.save(state, step=5).wait()
    shard = next((local / "step-000000005").glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor byte, in place: same size
    shard.write_bytes(bytes(data))
    remote = {"url": url, "storage_options": s3_server.storage_options}
    with Checkpointer(CheckpointConfig(root=str(local), remote=remote, staging={"mode": "eager"},
                                       network={"retries": 1, "backoff_s": 0.01})) as ckpt:
        assert len(ckpt.resumed_uploads) == 1  # the new Checkpointer uploads what was never uploaded
        err: BaseException | None = None
        for h in ckpt.resumed_uploads:
            try:
                h.wait_uploaded()
            except Exception as e:  # noqa: BLE001 - checked below
                err = e
        assert "do not match the CRC32C sent" in str(err) and shard.name in str(err)
        stats = ckpt.upload_checksums
        assert stats is not None and not any(p.endswith(shard.name) for p in stats.objects)
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    assert not fs.exists(f"{url.removeprefix('s3://')}/step-000000005/manifest.json")
