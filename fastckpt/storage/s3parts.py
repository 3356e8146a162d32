"""One S3 multipart upload driven request by request, so that several processes upload the parts of one object.

``s3checksum.s3_multipart`` is one process's whole upload. Here each request is its own call: rank 0 creates the
upload, every rank sends its own parts (each with its CRC32C, a part the store rejects as damaged is sent again),
rank 0 completes it with every rank's (part number, ETag, CRC32C), and any rank may abort it. Until it is completed
a multipart upload is invisible: the object under its key, if any, stays the previous one.

A process that dies between create and complete leaves the upload behind, billed until aborted. So rank 0 writes a
marker before the first part goes up (``.fastckpt/uploads/<uid>.json`` under the folder of the object, naming the
key and the upload id, which only the creator ever learns) and removes it after the complete or the abort.
``sweep`` aborts the uploads that markers of other, older processes prove fastckpt's (the trust rule: never abort
an upload fastckpt did not create) and removes those markers.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from typing import Any, Callable, Sequence

import crc32c as _crc32c

from .deadline import Deadline, describe, storage_error
from ..errors import FastCkptError
from .s3checksum import ObjectChecksum, b64, composite, resending
from .s3copy import source_gone

__all__ = ["MARKERS", "PartDone", "S3Parts", "marker_path", "parse_marker", "sweep"]

log = logging.getLogger("fastckpt")

MARKERS = ".fastckpt/uploads"  # under the folder of the object: where the markers of uploads in flight live
_PROCESS = uuid.uuid4().hex  # this process's uploads: never swept by this process, they may be in flight
_CONCURRENCY = 8  # parts of one rank in flight at once
_MAX_MARKER = 4096
PartDone = tuple[int, str, int, int]  # (part number, ETag, CRC32C, length)


def marker_path(folder: str, uid: str) -> str:
    """The marker of the upload of save ``uid`` (alike on every rank) into ``folder``."""
    return f"{folder.rstrip('/')}/{MARKERS}/{uid}.json"


class S3Parts:
    """The multipart requests of one S3 storage (``FsspecStorage.multipart()``); every request under the
    storage's deadline and retries, every failure a ``StorageError`` naming the object."""

    def __init__(self, fs: Any, deadline: Deadline, key_of: Callable[[str], str]) -> None:
        self.fs, self.deadline, self._key_of = fs, deadline, key_of

    def _run(self, op: str, path: str, coro: Callable[[], Any]) -> Any:
        from fsspec.asyn import sync

        try:
            return sync(self.fs.loop, coro)
        except Exception as e:
            if isinstance(e, FastCkptError):  # IntegrityError: a part damaged on every attempt
                raise
            raise storage_error(op, path, e, self.deadline) from e

    def _s3(self, path: str, method: str, **kw: Any) -> Callable[[], Any]:
        bucket, key, _ = self.fs.split_path(self._key_of(path))
        return lambda: self.fs._call_s3(method, Bucket=bucket, Key=key, **kw)

    def create(self, path: str) -> str:
        """CreateMultipartUpload of ``path`` (CRC32C parts); its upload id."""
        out = self._run("creating the multipart upload of", path, lambda: self.deadline.acall(
            f"create_multipart_upload of {path}", self._s3(path, "create_multipart_upload", ChecksumAlgorithm="CRC32C")))
        return str(out["UploadId"])

    def upload(self, path: str, upload_id: str, parts: Sequence[tuple[int, Callable[[], bytes]]]) -> tuple[list[PartDone], int]:
        """Send ``parts`` ((part number, a function that builds its body)) concurrently, each with its CRC32C;
        returns each one's (number, ETag, CRC32C, length) and how many the store rejected as damaged and got
        again. A body is built only when its part's turn comes: at most ``_CONCURRENCY`` are held at once."""
        gate = asyncio.Semaphore(_CONCURRENCY)
        resent = [0]

        async def one(number: int, build: Callable[[], bytes]) -> PartDone:
            async with gate:
                body = build()
                crc = _crc32c.crc32c(body)
                out = await resending(f"part {number} of {path}", self.deadline, self._s3(
                    path, "upload_part", PartNumber=number, UploadId=upload_id, Body=body, ChecksumAlgorithm="CRC32C",
                    ChecksumCRC32C=b64(crc)), resent)
            return number, str(out["ETag"]), crc, len(body)

        async def every() -> list[PartDone]:
            return list(await asyncio.gather(*[one(n, b) for n, b in parts]))

        done = self._run("uploading parts of", path, every) if parts else []
        return done, resent[0]

    def copy(self, path: str, upload_id: str, number: int, source: str, offset: int, length: int,
             crc: int) -> str | None:
        """UploadPartCopy of bytes ``[offset, offset+length)`` of the object ``source`` as part ``number``; its ETag,
        or None where the copy cannot stand for the local bytes whose CRC32C is ``crc`` (the source is gone, the
        store refused the range, or the copied part's CRC32C differs): the caller then sends the part."""
        sb, sk, _ = self.fs.split_path(self._key_of(source))
        try:
            out = self._run("copying a part of", path, lambda: self.deadline.acall(
                f"copy of part {number} of {path} from {source}", self._s3(
                    path, "upload_part_copy", PartNumber=number, UploadId=upload_id,
                    CopySource={"Bucket": sb, "Key": sk}, CopySourceRange=f"bytes={offset}-{offset + length - 1}")))
        except FastCkptError as e:
            if not source_gone(e):
                raise
            log.info("fastckpt: %s is gone or refused the range (%s): sending part %d of %s instead",
                     source, e, number, path)
            return None
        res = out["CopyPartResult"]
        if res.get("ChecksumCRC32C") != b64(crc):  # none returned: unverifiable, so sent (never a wrong copy)
            log.warning("fastckpt: the copy of part %d of %s from %s has CRC32C %s, the local bytes %s: sending it "
                        "instead", number, path, source, res.get("ChecksumCRC32C"), b64(crc))
            return None
        return str(res["ETag"])

    def complete(self, path: str, upload_id: str, done: Sequence[PartDone]) -> ObjectChecksum:
        """CompleteMultipartUpload with every rank's parts (in part order): the object appears whole, the commit."""
        ordered = sorted(done)
        listed = [{"PartNumber": n, "ETag": etag, "ChecksumCRC32C": b64(crc)} for n, etag, crc, _ in ordered]
        out = self._run("completing the multipart upload of", path, lambda: self.deadline.acall(
            f"complete_multipart_upload of {path}", self._s3(path, "complete_multipart_upload", UploadId=upload_id,
                                                              MultipartUpload={"Parts": listed})))
        self.fs.invalidate_cache(self._key_of(path))
        return ObjectChecksum(composite([d[2] for d in ordered]), out.get("ChecksumCRC32C"),
                              [(d[2], d[3]) for d in ordered])

    def abort(self, path: str, upload_id: str) -> bool:
        """AbortMultipartUpload; False (logged) where it failed: the marker then stays, for ``sweep``. An upload
        already gone (completed, or aborted by another rank) counts as aborted."""
        try:
            self._run("aborting the multipart upload of", path, lambda: self.deadline.acall(
                f"abort_multipart_upload of {path}", self._s3(path, "abort_multipart_upload", UploadId=upload_id)))
        except Exception as e:  # noqa: BLE001 - the upload's own error is the one to raise
            if "NoSuchUpload" in describe(e) or isinstance(e.__cause__, FileNotFoundError):
                return True
            log.warning("fastckpt: could not abort the multipart upload of %s: %s", path, e)
            return False
        return True

    def in_progress(self, path: str) -> list[str]:
        """The upload ids of the multipart uploads in progress for exactly the key of ``path``."""
        bucket, key, _ = self.fs.split_path(self._key_of(path))
        out = self._run("listing the multipart uploads of", path, lambda: self.deadline.acall(
            f"list_multipart_uploads of {path}", lambda: self.fs._call_s3(
                "list_multipart_uploads", Bucket=bucket, Prefix=key)))
        return [str(u["UploadId"]) for u in out.get("Uploads", []) if u.get("Key") == key]

    # ---- markers: the proof that an upload is fastckpt's ---------------------------------------------------

    @staticmethod
    def marker_bytes(path: str, upload_id: str) -> bytes:
        return json.dumps({"fastckpt": "multipart upload", "key": path, "upload_id": upload_id,
                           "process": _PROCESS, "pid": os.getpid(), "time": time.time()}).encode() + b"\n"


def parse_marker(data: bytes, folder: str) -> tuple[str, str, str] | None:
    """(object path, upload id, process) of a marker written by ``S3Parts.marker_bytes`` for an object in
    ``folder``, or None: anything else proves nothing."""
    if len(data) > _MAX_MARKER:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("fastckpt") != "multipart upload":
        return None
    path, upload_id, process = doc.get("key"), doc.get("upload_id"), doc.get("process")
    if not all(isinstance(v, str) and v for v in (path, upload_id, process)):
        return None
    prefix = folder.rstrip("/") + "/"
    rest = path[len(prefix):].split("/")
    # only an object of this very folder, or of one folder in it (Accelerate's checkpoint_N/model.safetensors)
    if not path.startswith(prefix) or len(rest) > 2 or any(p in ("", ".", "..") for p in rest):
        return None
    return path, upload_id, process


def sweep(storage: Any, parts: S3Parts, grace_s: float | None, dry_run: bool = False) -> list[str]:
    """Abort the multipart uploads that markers in ``storage.url`` prove fastckpt's, left by another process (a
    save killed between create and complete), once the marker is ``grace_s`` old; remove those markers. Returns
    the markers removed (or that would be, with ``dry_run``). Problems are logged, never raised: housekeeping must
    not fail a save."""
    if grace_s is None:
        return []
    folder = storage.url
    where = f"{folder.rstrip('/')}/{MARKERS}"
    aborted: list[str] = []
    try:
        names = storage.listdir(where)
    except Exception as e:  # noqa: BLE001 - logged: housekeeping
        log.info("fastckpt: the multipart uploads under %s were not swept: %s", folder, e)
        return []
    now = time.time()
    for name in sorted(names):
        mpath = f"{where}/{name}"
        try:
            if not name.endswith(".json") or now - storage.modified(mpath) < grace_s:
                continue
            found = parse_marker(storage.read_bytes(mpath), folder)
            if found is None or found[2] == _PROCESS:
                continue  # not a marker of ours; or this process's own upload, which may be in flight
            path, upload_id, _ = found
            if dry_run:
                aborted.append(mpath)
                continue
            if upload_id in parts.in_progress(path):  # the store confirms it: abort exactly that one
                if not parts.abort(path, upload_id):
                    continue  # the marker stays for the next sweep
                log.warning("fastckpt: aborted the multipart upload of %s left by a save that died", path)
            storage.delete(mpath)
            aborted.append(mpath)
        except Exception as e:  # noqa: BLE001 - logged: housekeeping
            log.info("fastckpt: cannot sweep the multipart upload of marker %s: %s", mpath, e)
    return aborted
