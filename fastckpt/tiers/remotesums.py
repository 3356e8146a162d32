"""What the store said about the bytes the remote tier uploaded: each object's checksum against the manifest's.

The storage sends every PUT and part with its CRC32C (``storage/s3checksum.py``), so the store itself rejects a
part damaged in flight. Here, after each file is up, the part CRCs sent are combined and compared with the
manifest's CRC32C (the bytes sent are the bytes committed), and the store's returned checksum with the one sent
(the store kept what was sent). A store that returns no checksum ignores the headers: that is counted in
``ChecksumStats.ignored`` (the storage logs it once), and the upload goes on, unverified by the store.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .dedup import DedupStats
from ..errors import IntegrityError
from ..format.checksum import combine
from ..storage.s3checksum import ObjectChecksum

__all__ = ["ChecksumStats"]


@dataclass
class ChecksumStats:
    """Per remote tier: how many uploaded files the store verified, how many it did not, and its checksums."""

    verified: int = 0  # files whose checksum the store returned equal to the one sent
    ignored: int = 0  # files the store returned no checksum for: it ignores x-amz-checksum-crc32c
    resent: int = 0  # parts or PUTs the store rejected as damaged in flight, sent again
    objects: dict[str, str] = field(default_factory=dict)  # remote path -> the store's checksum
    dedup: DedupStats = field(default_factory=DedupStats)  # bytes sent, and copied by the store (dedup.py)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, path: str, size: int, crc: int, got: ObjectChecksum | None) -> None:
        """Check one uploaded file (``size`` bytes, CRC32C ``crc`` by its manifest); raise ``IntegrityError``
        when what was sent, or what the store kept, is not what the manifest lists."""
        if got is None:
            return  # a store without S3 checksums (memory://, a file system): nothing to compare
        total, value = 0, 0
        for part_crc, length in got.parts:
            value = combine(value, part_crc, length) if total else part_crc
            total += length
        if total != size or (size and value != crc):
            raise IntegrityError(
                f"{path}: the bytes uploaded ({total} bytes, CRC32C {value:#010x}) are not the committed file "
                f"({size} bytes, CRC32C {crc:#010x} by its manifest): the local file changed after its commit; "
                "run `fastckpt verify` on the local checkpoint")
        if got.returned is not None and got.returned != got.sent:
            raise IntegrityError(
                f"{path}: the store answered checksum {got.returned!r} for the object, but {got.sent!r} was sent: "
                "it did not keep the bytes sent; upload the checkpoint again (Checkpointer.upload)")
        with self._lock:  # the storage logged it once (storage/fsspec.py): counted here
            self.resent += got.resent
            if got.returned is None:
                self.ignored += 1
            else:
                self.verified += 1
                self.objects[path] = got.returned
