"""Executing a dedup part plan (``partplan.py``) as one S3 multipart upload: sent parts carry their CRC32C, copied
parts are ``UploadPartCopy`` of a range of a previous object (``x-amz-copy-source-range``).

The new object is complete on its own: a server-side copy duplicates the bytes, so deleting the old object later
changes nothing. Every copied part is checked: its CRC32C is computed from the local bytes it stands for, and the
store's answer for the copy (S3 and SeaweedFS return the part's ``ChecksumCRC32C`` when the upload was created with
that algorithm) must equal it; so the object's composite checksum is still the one of the local file, which
``tiers/remotesums.py`` compares with the manifest. A copy whose source is gone (retention deleted the older
checkpoint between the plan and the copy), whose range the store refuses, or whose checksum differs is sent
instead from the local bytes (``CopyOutcome.fell_back``). A store that returns no checksum for a copy leaves that
part unverified by it (``CopyOutcome.unverified``).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import crc32c as _crc32c

from .deadline import Deadline, describe
from .joined import Joined
from .partplan import Part
from .s3checksum import Marked, ObjectChecksum, b64, complete_or_abort, composite, resending, start_multipart

__all__ = ["CopyOutcome", "s3_planned_upload", "source_gone"]

log = logging.getLogger("fastckpt")

_CONCURRENCY = 8  # parts in flight at once (as s3checksum)
# What a store answers when a copy's source is missing or its range is not there, or when it does not do
# UploadPartCopy at all (or not for these credentials): the bytes are sent instead, never a failed upload
_SOURCE_GONE = frozenset({"NoSuchKey", "NoSuchBucket", "InvalidRange", "InvalidArgument", "InvalidRequest", "404",
                          "NotImplemented", "MethodNotAllowed", "AccessDenied", "501", "405", "403"})


@dataclass
class CopyOutcome:
    """What one planned upload did."""

    checksum: ObjectChecksum
    sent: int = 0  # bytes sent in parts (including copies that fell back)
    copied: int = 0  # bytes copied server-side from a previous object
    fell_back: int = 0  # bytes planned as a copy but sent (source gone, refused, or checksum mismatch)
    unverified: int = 0  # copied parts for which the store returned no checksum


def source_gone(e: BaseException) -> bool:
    """Whether ``e`` (or what it was raised from) says a copy's source or range is not there, or copies are
    refused: the part is then sent instead."""
    cur: BaseException | None = e
    while cur is not None:
        if isinstance(cur, FileNotFoundError):
            return True
        code = ((getattr(cur, "response", None) or {}).get("Error") or {}).get("Code")
        if code in _SOURCE_GONE:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


async def s3_planned_upload(fs: Any, deadline: Deadline, path: str, view: memoryview | Joined,
                            plan: Sequence[Part], marked: Marked | None = None) -> CopyOutcome:
    """Upload ``view`` (the whole new object) to ``path`` by ``plan``; copy sources are ``bucket/key`` paths.
    Aborted on any failure but a copy that can be sent instead; ``marked``: as ``start_multipart``."""
    view = view if isinstance(view, Joined) else memoryview(view).cast("B")  # a file written as parts: not joined
    s3, upload_id = await start_multipart(deadline, fs, path, marked)
    gate = asyncio.Semaphore(_CONCURRENCY)
    resent = [0]
    out = CopyOutcome(ObjectChecksum("", None))

    async def send(number: int, p: Part) -> tuple[dict[str, Any], int]:
        body = bytes(view[p.offset: p.offset + p.length])  # botocore wants bytes
        crc = _crc32c.crc32c(body)
        res = await resending(f"part {number} of {path}", deadline, s3(
            "upload_part", PartNumber=number, UploadId=upload_id, Body=body, ChecksumAlgorithm="CRC32C",
            ChecksumCRC32C=b64(crc)), resent)
        out.sent += p.length
        return {"PartNumber": number, "ETag": res["ETag"], "ChecksumCRC32C": b64(crc)}, crc

    async def copy(number: int, p: Part) -> tuple[dict[str, Any], int]:
        crc = _crc32c.crc32c(view[p.offset: p.offset + p.length])  # what the copied bytes must be
        sb, sk, _ = fs.split_path(p.source)
        try:
            res = (await deadline.acall(f"copy of part {number} of {path} from {p.source}", s3(
                "upload_part_copy", PartNumber=number, UploadId=upload_id, CopySource={"Bucket": sb, "Key": sk},
                CopySourceRange=f"bytes={p.source_offset}-{p.source_offset + p.length - 1}")))["CopyPartResult"]
        except Exception as e:
            if not source_gone(e):
                raise
            log.info("fastckpt: %s is gone or refused the range (%s): sending part %d of %s instead",
                     p.source, describe(e), number, path)
            out.fell_back += p.length
            return await send(number, p)
        got = res.get("ChecksumCRC32C")
        if got is None:
            out.unverified += 1
        elif got != b64(crc):  # the old object's bytes are not what its manifest hashed: never keep them
            log.warning("fastckpt: the copy of part %d of %s from %s has CRC32C %s, the local bytes %s: sending "
                        "it instead", number, path, p.source, got, b64(crc))
            out.fell_back += p.length
            return await send(number, p)
        out.copied += p.length
        return {"PartNumber": number, "ETag": res["ETag"], "ChecksumCRC32C": b64(crc)}, crc

    async def one(number: int, p: Part) -> tuple[dict[str, Any], int, int]:
        async with gate:  # at most _CONCURRENCY bodies copied out at once
            done, crc = await (send(number, p) if p.kind == "send" else copy(number, p))
        return done, crc, p.length

    done, res = await complete_or_abort(deadline, s3, path, upload_id,
                                        asyncio.gather(*[one(i + 1, p) for i, p in enumerate(plan)]))
    fs.invalidate_cache(path)
    out.checksum = ObjectChecksum(composite([d[1] for d in done]), res.get("ChecksumCRC32C"),
                                  [(d[1], d[2]) for d in done], resent[0])
    return out
