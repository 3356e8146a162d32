"""The fsspec backend: any fsspec filesystem (``s3://``, ``memory://``, ``gs://``...), every request
under a deadline with bounded retries (``deadline.py``).

Object stores have no rename, so a file appears whole by being one PUT (or one multipart
upload, whose parts go up concurrently); the manifest, written last with one PUT, is the
commit. On ``s3://`` botocore's socket timeouts default to the deadline, and botocore's and
s3fs's own retry loops to one attempt: retries happen here, where they are bounded.
"""
from __future__ import annotations

import contextlib
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Iterator, Sequence

from ..config import NetworkOptions
from .deadline import Deadline, describe, in_thread, storage_error
from .s3checksum import PART_BYTES, Marked, ObjectChecksum, s3_multipart, s3_put
from .s3parts import S3Parts, marker_path
from .partplan import Part
from .s3copy import CopyOutcome, s3_planned_upload
from .tempmark import mark_bytes, mark_name, temp_basename
from ..errors import MissingCredentialsError, StorageError

__all__ = ["FsspecStorage"]

log = logging.getLogger("fastckpt")

_READ_PIECE = 16 * 1024 * 1024  # ranged-read size for remote loads
_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "memory")  # objects appear whole: no rename


class FsspecStorage:
    """Any fsspec filesystem (s3://, memory://, gs://...). Object stores commit by PUT.

    Every request runs under ``network`` deadlines with bounded retries (see ``deadline.py``):
    a stalled endpoint fails the operation with a ``StorageError`` instead of hanging it.
    """

    def __init__(self, url: str, storage_options: dict[str, Any], workers: int = 4,
                 network: NetworkOptions | None = None) -> None:
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec is a hard dependency
            raise StorageError("fsspec is required for remote roots: pip install fsspec") from e
        self._protocol = url.split("://", 1)[0]
        self._deadline = Deadline.of(network)
        options = _with_socket_timeouts(self._protocol, storage_options, self._deadline)
        try:
            fs, path = fsspec.core.url_to_fs(url, **options)
        except ImportError as e:
            raise StorageError(f"no fsspec backend for {url!r}: {e}. For s3:// install fastckpt[s3] (s3fs)") from e
        except (ValueError, TypeError) as e:
            raise StorageError(f"cannot open storage {url!r}: {e}") from e
        if self._protocol in ("s3", "s3a"):
            fs.retries = 1  # s3fs's own retry loop (a class attribute, 5) would nest inside ours
        self.fs = fs
        self.url = f"{self._protocol}://{path}" if "://" in url else path
        self._workers = workers
        self.checksums_ignored = 0  # S3 writes the store returned no checksum for (it ignores the headers)

    def _p(self, path: str) -> str:
        return path.split("://", 1)[1] if "://" in path else path

    def join(self, *parts: str) -> str:
        return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))

    def _call(self, op: str, path: str, method: str, *args: Any, missing: str = "wrap", **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)`` under the deadline, retried; errors become ``StorageError``
        naming ``path``."""
        fs = self.fs
        if getattr(fs, "async_impl", False) and hasattr(fs, f"_{method}"):
            from fsspec.asyn import sync

            # cancelled on the event loop at the deadline: botocore/aiohttp may never give up alone
            def attempt(t: float) -> Any:
                return sync(fs.loop, getattr(fs, f"_{method}"), *args, timeout=t, **kwargs)
        else:
            def attempt(t: float) -> Any:
                return in_thread(partial(getattr(fs, method), *args, **kwargs), t, f"fastckpt-net-{method}")
        with _backend_errors(op, path, missing, self._deadline):
            return self._deadline.call(f"{op} {path}", attempt)

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        self.write_checked(path, parts)

    def write_checked(self, path: str, parts: Sequence[memoryview], crc32c: int | None = None) -> ObjectChecksum | None:
        """``write_file`` that, on S3, sends every PUT and part with its CRC32C (``crc32c``: the whole file's,
        when the caller has it) so the store rejects bytes damaged in flight (``s3checksum.py``); returns what
        was sent and what the store answered, or None on a store without S3 checksums."""
        total = sum(len(p) for p in parts)
        if self._protocol in ("s3", "s3a"):
            from fsspec.asyn import sync

            p = self._p(path)
            with _backend_errors("uploading", path, "wrap", self._deadline):
                if total > 2 * PART_BYTES:
                    with self._marking(path) as marked:
                        out = sync(self.fs.loop, s3_multipart, self.fs, self._deadline, p, parts, marked)
                else:
                    out = sync(self.fs.loop, s3_put, self.fs, self._deadline, p, b"".join(parts), crc32c)
            if isinstance(out, ObjectChecksum) and out.returned is None:
                self._note_ignored(path)
            return out if isinstance(out, ObjectChecksum) else None
        if getattr(self.fs, "async_impl", False) and total <= 2 * PART_BYTES:
            self._call("uploading", path, "pipe_file", self._p(path), b"".join(parts))  # one PUT
        else:  # streamed through the backend's file writer: one deadline per 32 MiB
            scale = max(1, -(-total // (2 * PART_BYTES)))
            with _backend_errors("uploading", path, "wrap", self._deadline):
                # an abandoned attempt may still read ``parts``, which the caller reuses once this fails
                self._deadline.call(f"uploading {path}", lambda t: in_thread(
                    partial(self._stream, self._p(path), parts), t * scale, "fastckpt-net-write"),
                    retry_timeouts=False)
        return None

    @property
    def copies_ranges(self) -> bool:
        """Whether ``write_planned`` can copy ranges server-side (S3's ``UploadPartCopy``)."""
        return self._protocol in ("s3", "s3a")

    def write_planned(self, path: str, view: memoryview, plan: Sequence[Part]) -> CopyOutcome:
        """Write ``view`` to ``path`` by a dedup part plan (``partplan.py``): its copied parts come from the
        objects they name (URLs of this storage) server-side, the rest is sent; S3 only (``copies_ranges``)."""
        from fsspec.asyn import sync

        plan = [p._replace(source=self._p(p.source)) if p.source else p for p in plan]
        with _backend_errors("uploading", path, "wrap", self._deadline), self._marking(path) as marked:
            out = sync(self.fs.loop, s3_planned_upload, self.fs, self._deadline, self._p(path), view, plan, marked)
        if out.checksum.returned is None:
            self._note_ignored(path)
        return out

    @contextlib.contextmanager
    def _marking(self, path: str) -> Iterator[Marked]:
        """The marker of one multipart upload of ``path`` (``<root>/.fastckpt/uploads/UID.json``, as a shared upload's,
        ``s3parts.py``), written once the upload exists and removed when it is completed or aborted: a process killed
        in between leaves the proof with which the next start's sweep aborts that upload (an upload without a
        marker is never touched)."""
        mpath = marker_path(self.url, uuid.uuid4().hex)
        written = []

        async def marked(upload_id: str) -> None:
            data = S3Parts.marker_bytes(path, upload_id)
            await self._deadline.acall(f"writing the upload marker {mpath}", lambda: self.fs._pipe_file(
                self._p(mpath), data))
            written.append(mpath)

        try:
            yield marked
        finally:
            if written:
                try:
                    self.delete(mpath)
                except Exception as e:  # noqa: BLE001 - a leftover marker of a finished upload: the sweep drops it
                    log.info("fastckpt: could not remove the upload marker %s: %s", mpath, e)

    def _note_ignored(self, path: str) -> None:
        """Count (``checksums_ignored``) and say once that the store returns no checksum: it does not check the
        bytes it receives. The writes go on; the manifest's CRC32C still checks every read."""
        self.checksums_ignored += 1
        if self.checksums_ignored == 1:
            log.warning("fastckpt: the store of %s returned no checksum for %s: it ignores x-amz-checksum-crc32c, "
                        "so it does not check the bytes it receives (writes go on; the manifest's CRC32C still checks "
                        "every read)", self.url, path)

    def multipart(self) -> Any:
        """The multipart requests of this ``s3://`` storage, one at a time (``s3parts.S3Parts``: several ranks
        upload the parts of one object), or None on another store."""
        if self._protocol not in ("s3", "s3a"):
            return None
        from .s3parts import S3Parts

        return S3Parts(self.fs, self._deadline, self._p)

    def object_checksum(self, path: str) -> str | None:
        """The CRC32C the store keeps for the object ``path`` (S3's form, ``s3checksum.py``), or None (another
        store, or an object uploaded without one): what a verified read compares the bytes with."""
        if self._protocol not in ("s3", "s3a"):
            return None
        from fsspec.asyn import sync

        fs = self.fs
        bucket, key, _ = fs.split_path(self._p(path))
        head = self._deadline.call(f"stat of {path}", lambda t: sync(
            fs.loop, fs._call_s3, "head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED", timeout=t))
        value = head.get("ChecksumCRC32C")
        return str(value) if value else None

    def _stream(self, path: str, parts: Sequence[memoryview]) -> None:
        with self.fs.open(path, "wb", block_size=64 << 20) as f:
            for part in parts:
                f.write(part)

    def write_atomic(self, path: str, data: bytes) -> None:
        if self._protocol in ("s3", "s3a"):
            self.write_checked(path, [memoryview(data)])  # one checked PUT: whole or not at all
            return
        self._call("committing", path, "pipe_file", self._p(path), data)  # one PUT: whole or not at all

    def write_file_atomic(self, path: str, parts: Sequence[memoryview]) -> None:
        if self._protocol in _OBJECT_STORES:  # a PUT or a completed multipart upload appears whole
            self.write_file(path, parts)
            return
        folder, base = path.rsplit("/", 1) if "/" in path else ("", path)
        tmp = f"{folder}/{temp_basename(base)}"
        self.mark_temp(tmp)  # the proof gc needs to remove it after a crash (storage/tempmark.py)
        try:
            self.write_file(tmp, parts)
            self._call("renaming into", path, "mv", self._p(tmp), self._p(path))
        except StorageError:
            with contextlib.suppress(Exception):
                self.fs.rm_file(self._p(tmp))
            self.unmark_temp(tmp)
            raise
        self.unmark_temp(tmp)

    def mark_temp(self, tmp: str) -> None:
        """Write the marker of the temporary file ``tmp`` before its first byte (storage/tempmark.py)."""
        self._call("creating the marker of", tmp, "pipe_file", self._p(mark_name(tmp)),
                   mark_bytes(tmp.rsplit("/", 1)[-1]))

    def unmark_temp(self, tmp: str) -> None:
        """Remove the marker once ``tmp`` is renamed or removed; a leftover one is collected by gc."""
        try:
            self.delete(mark_name(tmp))
        except StorageError as e:
            log.info("fastckpt: could not remove the marker of %s: %s", tmp, e)

    def read_plain(self, path: str, offset: int, n: int) -> bytes | None:
        """At most ``n`` bytes of the file ``path`` from ``offset`` (None if it is not a file): gc's proofs."""
        try:
            size = self.size(path)
        except (FileNotFoundError, StorageError):
            return None
        out = bytearray(max(0, min(n, size - offset)))
        if out:
            self.read_into(path, offset, memoryview(out))
        return bytes(out)

    def is_plain_file(self, path: str) -> bool:
        """Whether ``path`` is a file (object stores have no symlinks)."""
        try:
            return bool(self._call("checking", path, "isfile", self._p(path)))
        except StorageError:
            return False

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        pieces = [(s, min(s + _READ_PIECE, len(out))) for s in range(0, len(out), _READ_PIECE)]

        def fetch(piece: tuple[int, int]) -> None:
            start, end = piece
            data = self._call("reading", path, "cat_file", self._p(path), start=offset + start, end=offset + end)
            if len(data) != end - start:
                raise StorageError(f"reading {path!r} failed: short read at {offset + start}: got {len(data)} of "
                                   f"{end - start} bytes")
            out[start:end] = data

        if len(pieces) <= 1:
            for p in pieces:
                fetch(p)
        else:  # concurrent ranged GETs: one connection rarely fills the link
            with ThreadPoolExecutor(self._workers, thread_name_prefix="fastckpt-read") as pool:
                list(pool.map(fetch, pieces))

    def read_bytes(self, path: str) -> bytes:
        return self._call("reading", path, "cat_file", self._p(path), missing="raise")

    def size(self, path: str) -> int:
        return int(self._call("stat of", path, "size", self._p(path), missing="raise"))

    def modified(self, path: str) -> float:
        """Last modification (seconds since the epoch) of one object, by the store's clock."""
        return float(self._call("stat of", path, "modified", self._p(path)).timestamp())

    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(self._p(path))  # s3fs caches listings per instance
        return bool(self._call("checking", path, "exists", self._p(path)))

    def listdir(self, path: str) -> list[str]:
        self.fs.invalidate_cache(self._p(path))
        entries = self._call("listing", path, "ls", self._p(path), detail=False, missing="ignore") or []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def delete(self, path: str) -> None:
        self._call("deleting", path, "rm_file", self._p(path), missing="ignore")

    def delete_tree(self, path: str) -> None:
        self._call("deleting", path, "rm", self._p(path), recursive=True, missing="ignore")

    def check(self, what: str) -> None:
        """One cheap request: on ``s3://``, list at most one key under the root (what ``latest()`` needs,
        and allowed by a policy scoped to the prefix, unlike HEAD bucket); elsewhere, ``exists``."""
        if self._protocol not in ("s3", "s3a"):
            self._call(f"checking {what}", self.url, "exists", self._p(self.url))
            return
        bucket, _, key = self._p(self.url).partition("/")
        try:
            self._deadline.call(f"checking {what} {self.url}", self._list_one(bucket, key.strip("/")))
        except Exception as e:
            raise _probe_error(what, self.url, bucket, _endpoint(self.fs), e, self._deadline) from e

    def _list_one(self, bucket: str, key: str) -> Callable[[float], Any]:
        from fsspec.asyn import sync

        fs = self.fs
        prefix = f"{key}/" if key else ""
        return lambda t: sync(fs.loop, fs._call_s3, "list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1,
                              timeout=t)


def _with_socket_timeouts(protocol: str, options: dict[str, Any], deadline: Deadline) -> dict[str, Any]:
    """s3fs options that leave timeouts and retries to ``Deadline``, unless the caller set them.

    Left alone, botocore (up to 5 attempts, 60 s socket timeouts) runs inside s3fs's own retry loop
    (5 more), so one request to a dead endpoint takes minutes and its last error is lost.
    """
    if protocol not in ("s3", "s3a"):
        return options
    options = dict(options)
    kwargs = dict(options.get("config_kwargs") or {})
    kwargs.setdefault("connect_timeout", min(10.0, deadline.timeout_s))
    kwargs.setdefault("read_timeout", deadline.timeout_s)
    # botocore: a single try. Its "max_attempts" counts the retries (1 would be a second try, after its own
    # jittered backoff of up to a second, logged nowhere of ours); "total_max_attempts" counts every try.
    kwargs.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    options["config_kwargs"] = kwargs
    return options


def _endpoint(fs: Any) -> str:
    """The endpoint the client talks to: the one it resolved (``endpoint_url``, ``client_kwargs``, or botocore's
    ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3`` and config file), else what the options and environment name."""
    try:  # s3fs's botocore client (built by the failed request already): it knows where it went
        resolved = fs.s3.meta.endpoint_url
    except Exception:  # noqa: BLE001 - another backend, or no client: fall back to what was named
        resolved = None
    named = (getattr(fs, "endpoint_url", None) or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url")
             or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"))
    found = resolved or named
    if not found:
        return "the default AWS endpoint"
    return str(found) if named else f"{found} (AWS)"


def _probe_error(what: str, url: str, bucket: str, endpoint: str, e: BaseException, deadline: Deadline) -> StorageError:
    """The one actionable error for a storage that cannot hold checkpoints."""
    if MissingCredentialsError.caused(e):
        return MissingCredentialsError(f"{what} {url!r} cannot hold checkpoints: " + MissingCredentialsError.fix(
            f"the storage options of {what} (storage_options / remote.storage_options)"))
    if isinstance(e, FileNotFoundError):
        why = f"bucket {bucket!r} does not exist at {endpoint}: fix the bucket name in {what}, or create the bucket"
    elif isinstance(e, PermissionError):
        why = f"access to bucket {bucket!r} at {endpoint} was denied: check the credentials and the bucket policy"
    elif isinstance(e, TimeoutError):
        why = (f"{endpoint} did not answer within {deadline.timeout_s:g}s ({deadline.attempts} attempt(s)): check "
               f"client_kwargs.endpoint_url and the network, or raise network.timeout_s")
    else:
        why = f"{endpoint} cannot be reached or refused the request ({describe(e)}): check client_kwargs.endpoint_url " \
              "and the network"
    err = StorageError(f"{what} {url!r} cannot hold checkpoints: {why}")
    if isinstance(e, OSError):
        err.errno = e.errno
    return err


@contextlib.contextmanager
def _backend_errors(op: str, path: str, missing: str = "wrap", deadline: Deadline | None = None) -> Iterator[None]:
    """Turn a backend's exceptions into ``StorageError`` naming ``path``.

    ``missing`` decides about FileNotFoundError: ``raise`` it as is (callers test for absence),
    ``ignore`` it (deleting what is gone is fine), or ``wrap`` it like any other error.
    """
    try:
        yield
    except StorageError:
        raise
    except FileNotFoundError as e:
        if missing == "raise":
            raise
        if missing != "ignore":
            raise storage_error(op, path, e, deadline) from e
    except Exception as e:
        raise storage_error(op, path, e, deadline) from e
