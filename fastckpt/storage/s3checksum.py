"""S3 uploads the store verifies: every PUT and part carries its CRC32C (``x-amz-checksum-crc32c``).

A PUT sends the whole object's CRC32C (the one the manifest records, when the caller has it);
a multipart upload sends each part's CRC32C, and S3 answers with the composite checksum
``base64(crc32c(crc_1 || ... || crc_N))-N`` (each CRC big-endian). The server recomputes each
checksum over the bytes it received and rejects a mismatch (``BadDigest``): a part damaged in
flight is sent again, up to the deadline's retries. What the server returned is kept in an
``ObjectChecksum`` for the caller to compare; ``None`` there means the store ignores the
checksum headers (the upload goes on, unverified by the store).
"""
from __future__ import annotations

import asyncio
import base64
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import crc32c as _crc32c

from .deadline import Deadline, describe
from .partplan import MAX_PARTS
from ..errors import IntegrityError

__all__ = ["Marked", "ObjectChecksum", "PART_BYTES", "b64", "complete_or_abort", "composite", "digest_rejected", "expected_like",
           "part_bytes", "pieces", "resending", "s3_multipart", "s3_put", "start_multipart"]

log = logging.getLogger("fastckpt")

Marked = Callable[[str], Awaitable[Any]]  # called with a new upload's id before its first part: writes its marker

PART_BYTES = 16 * 1024 * 1024  # multipart part size (S3 minimum is 5 MiB); a verified read cuts the same parts
_CONCURRENCY = 8  # parts of one file in flight at once
# S3's error codes for a body that does not match the checksum sent with it (AWS: BadDigest;
# some stores answer with the others)
_DIGEST_CODES = frozenset({"BadDigest", "InvalidDigest", "XAmzContentChecksumMismatch", "XAmzContentSHA256Mismatch"})


@dataclass
class ObjectChecksum:
    """The checksum of one uploaded object: what was sent, and what the store says it stored."""

    sent: str  # base64 CRC32C of a PUT, or the composite "<base64>-N" of a multipart upload
    returned: str | None  # the store's answer; None when it ignores the checksum headers
    parts: list[tuple[int, int]] = field(default_factory=list)  # (crc32c, length) of each part, in order
    resent: int = 0  # parts (or PUTs) the store rejected as damaged and that were sent again


def part_bytes(total: int) -> int:
    """The part size of a ``total``-byte multipart upload: ``PART_BYTES``, grown in whole MiB for a file that
    would need more than S3's 10,000 parts (over 156 GiB). A verified read derives the same size."""
    mib = 1 << 20
    per = -(-total // MAX_PARTS)  # the smallest part that fits in 10,000, rounded up to a MiB
    return max(PART_BYTES, -(-per // mib) * mib)


def b64(crc: int) -> str:
    """S3's form of a CRC32C: base64 of its 4 bytes, big-endian."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def composite(crcs: Sequence[int]) -> str:
    """S3's composite checksum of a multipart upload: the CRC32C of the parts' CRCs, then ``-N``."""
    joined = b"".join(c.to_bytes(4, "big") for c in crcs)
    return f"{b64(_crc32c.crc32c(joined))}-{len(crcs)}"


def expected_like(data: bytes | memoryview, server: str) -> str | None:
    """The checksum of ``data`` in the form of the store's ``server`` value (full object, or composite of
    ``PART_BYTES`` parts); None when ``server`` is a composite of parts of another size (another uploader)."""
    _, sep, n = server.partition("-")
    if not sep:
        return b64(_crc32c.crc32c(data))
    view = memoryview(data).cast("B")
    size = part_bytes(len(view))
    if not n.isdigit() or int(n) != max(1, -(-len(view) // size)):
        return None
    return composite([_crc32c.crc32c(view[i: i + size]) for i in range(0, max(len(view), 1), size)])


def digest_rejected(e: BaseException) -> bool:
    """Whether ``e`` (s3fs's OSError, caused by botocore's ClientError) is the store rejecting a body whose
    bytes do not match the checksum sent with it: damaged in flight, worth sending again."""
    cur: BaseException | None = e
    while cur is not None:
        code = ((getattr(cur, "response", None) or {}).get("Error") or {}).get("Code")
        if code in _DIGEST_CODES:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


async def _resending(what: str, deadline: Deadline, send: Callable[[], Awaitable[Any]], sent: list[int]) -> Any:
    """``send()`` under the deadline; a body the store rejected as damaged is sent again (``deadline.retries``
    more times: damage that repeats is not in flight, and the error says so)."""
    for n in range(deadline.retries + 1):
        try:
            return await deadline.acall(what, send)
        except Exception as e:
            if not digest_rejected(e):
                raise
            if n == deadline.retries:
                raise IntegrityError(
                    f"the store rejected {what} {n + 1} times: its bytes do not match the CRC32C sent with them. "
                    "Either the source changed after its checksum was taken (run `fastckpt verify` on it) or the "
                    "network damages every attempt") from e
            sent[0] += 1
            log.warning("fastckpt: the store rejected %s as damaged in flight (%s); sending it again (%d of %d)",
                        what, describe(e), n + 1, deadline.retries)
    raise AssertionError("unreachable")  # pragma: no cover


resending = _resending  # the one resend loop for damaged bodies, also for the planned uploads of s3copy.py


async def s3_put(fs: Any, deadline: Deadline, path: str, data: bytes, crc: int | None = None) -> ObjectChecksum:
    """One PutObject of ``data`` carrying its CRC32C (``crc`` when the caller has it, else computed)."""
    bucket, key, _ = fs.split_path(path)
    crc = _crc32c.crc32c(data) if crc is None else crc
    value = b64(crc)
    resent = [0]
    out = await _resending(f"PUT of {path}", deadline, lambda: fs._call_s3(
        "put_object", Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm="CRC32C", ChecksumCRC32C=value), resent)
    fs.invalidate_cache(path)
    return ObjectChecksum(value, out.get("ChecksumCRC32C"), [(crc, len(data))], resent[0])


async def s3_multipart(fs: Any, deadline: Deadline, path: str, parts: Sequence[memoryview],
                       marked: Marked | None = None) -> ObjectChecksum:
    """One multipart upload whose parts go up concurrently, each with its CRC32C; aborted on any failure.

    Each request (create, every part, complete, abort) has its own deadline and retries."""
    s3, upload_id = await start_multipart(deadline, fs, path, marked)
    gate = asyncio.Semaphore(_CONCURRENCY)
    resent = [0]

    async def one(number: int, piece: memoryview) -> tuple[dict[str, Any], int, int]:
        async with gate:  # at most _CONCURRENCY bodies copied out at once
            body = bytes(piece)  # botocore wants bytes
            crc = _crc32c.crc32c(body)
            out = await _resending(f"part {number} of {path}", deadline, s3(
                "upload_part", PartNumber=number, UploadId=upload_id, Body=body, ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=b64(crc)), resent)
        return {"PartNumber": number, "ETag": out["ETag"], "ChecksumCRC32C": b64(crc)}, crc, len(body)

    size = part_bytes(sum(len(p) for p in parts))
    done, out = await complete_or_abort(deadline, s3, path, upload_id,
                                        asyncio.gather(*[one(i + 1, p) for i, p in enumerate(pieces(parts, size))]))
    fs.invalidate_cache(path)
    return ObjectChecksum(composite([d[1] for d in done]), out.get("ChecksumCRC32C"),
                          [(d[1], d[2]) for d in done], resent[0])


def pieces(parts: Sequence[memoryview], size: int) -> list[memoryview]:
    """Cut the concatenation of ``parts`` into ``size``-byte pieces (the last may be shorter)."""
    out: list[memoryview] = []
    carry = b""
    for part in parts:
        part = memoryview(part).cast("B")
        if carry:
            need = size - len(carry)
            carry += bytes(part[:need])
            part = part[need:]
            if len(carry) < size:
                continue
            out.append(memoryview(carry))
            carry = b""
        whole = len(part) - len(part) % size
        out.extend(part[i: i + size] for i in range(0, whole, size))
        carry = bytes(part[whole:])
    if carry:
        out.append(memoryview(carry))
    return out


resending = _resending  # public for storage/s3parts.py: a shared upload's parts are resent alike


async def complete_or_abort(deadline: Deadline, s3: Callable[..., Awaitable[Any]], path: str, upload_id: str,
                            parts: Awaitable[list[Any]]) -> tuple[list[Any], dict[str, Any]]:
    """Await ``parts`` (each ``(part entry, ...)``), then complete the multipart upload ``upload_id`` of ``path``
    with their entries; on any failure (a part's, the complete's, a cancel) abort it first, then raise."""
    try:
        done = await parts
        out = await deadline.acall(f"complete_multipart_upload of {path}", s3(
            "complete_multipart_upload", UploadId=upload_id, MultipartUpload={"Parts": [d[0] for d in done]}))
    except BaseException:
        await _abort(deadline, s3, path, upload_id)
        raise
    return done, out


async def _abort(deadline: Deadline, s3: Callable[..., Callable[[], Awaitable[Any]]], path: str,
                 upload_id: str) -> None:
    try:  # no orphaned parts billed forever (best effort: the endpoint may be what failed)
        await deadline.acall(f"abort_multipart_upload of {path}", s3("abort_multipart_upload", UploadId=upload_id))
    except Exception as e:  # noqa: BLE001 - the upload's own error is the one to raise
        log.warning("fastckpt: could not abort the multipart upload of %s: %s", path, describe(e))


async def start_multipart(deadline: Deadline, fs: Any, path: str, marked: Marked | None = None,
                          ) -> tuple[Callable[..., Callable[[], Awaitable[Any]]], str]:
    """Create a CRC32C multipart upload of ``path``: returns ``s3(method, **kw)`` (a request on that object, for the
    deadline to call) and the upload id. ``marked(upload_id)`` runs before any part goes up (the marker that lets the
    next start abort the upload if this process dies, ``s3parts.sweep``); if it fails the upload is aborted."""
    bucket, key, _ = fs.split_path(path)

    def s3(method: str, **kw: Any) -> Callable[[], Awaitable[Any]]:
        return lambda: fs._call_s3(method, Bucket=bucket, Key=key, **kw)

    mpu = await deadline.acall(f"create_multipart_upload of {path}", s3("create_multipart_upload",
                                                                        ChecksumAlgorithm="CRC32C"))
    if marked is not None:
        try:
            await marked(mpu["UploadId"])
        except BaseException:  # no marker: nothing could ever prove the upload fastckpt's, so it must go now
            await _abort(deadline, s3, path, mpu["UploadId"])
            raise
    return s3, mpu["UploadId"]
