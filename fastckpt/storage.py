"""Storage backends: one small protocol, a local fast path, and fsspec for the rest.

Only this module touches fsspec. Errors are raised as ``StorageError`` naming the
path, chained to the backend's exception.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

from .errors import StorageError

__all__ = ["Storage", "LocalStorage", "FsspecStorage", "open_storage"]

log = logging.getLogger("fastckpt")

_DIRECT_ALIGN = 4096
_READ_PIECE = 16 * 1024 * 1024  # ranged-read size for remote loads
_S3_PART = 16 * 1024 * 1024  # multipart part size (S3 minimum is 5 MiB)
_S3_CONCURRENCY = 8  # parts of one file in flight at once
_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "memory")  # objects appear whole, no rename needed


@runtime_checkable
class Storage(Protocol):
    """What the pipeline needs from a place that holds checkpoints."""

    url: str

    def join(self, *parts: str) -> str:
        """Called by everyone to build child paths."""

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        """Called by an I/O worker: write ``parts`` back to back as one new, durable file."""

    def write_atomic(self, path: str, data: bytes) -> None:
        """Called by the committer: make ``path`` appear with ``data`` all at once (the commit)."""

    def write_file_atomic(self, path: str, parts: Sequence[memoryview]) -> None:
        """Called by the committer of a single-file checkpoint: ``write_file`` that appears only once complete."""

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        """Called by loaders: fill ``out`` from ``path`` starting at ``offset``."""

    def read_bytes(self, path: str) -> bytes:
        """Called by loaders for small files (manifest, metadata)."""

    def size(self, path: str) -> int:
        """File size in bytes; raises FileNotFoundError when absent."""

    def exists(self, path: str) -> bool:
        """Whether a file exists at ``path``."""

    def listdir(self, path: str) -> list[str]:
        """Names directly under ``path`` (empty when it does not exist)."""

    def delete(self, path: str) -> None:
        """Remove one file; missing is fine."""

    def delete_tree(self, path: str) -> None:
        """Remove a directory and everything under it; missing is fine."""


def _wrap(op: str, path: str, e: BaseException) -> StorageError:
    err = StorageError(f"{op} {path!r} failed: {e}")
    if isinstance(e, OSError):
        err.errno = e.errno
    return err


class LocalStorage:
    """Local files with large sequential writes, O_DIRECT where the filesystem allows it."""

    def __init__(self, root: str, direct_io: str = "auto", fsync: bool = True) -> None:
        self.url = os.path.abspath(root.removeprefix("file://"))
        self._direct = direct_io
        self._fsync = fsync
        self._direct_works: bool | None = None if direct_io == "auto" else direct_io == "on"

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if self._direct_works is not False and _aligned(parts) and hasattr(os, "O_DIRECT"):
                if self._write_direct(path, parts):
                    return
            self._write_buffered(path, parts)
        except OSError as e:
            raise _wrap("writing", path, e) from e

    def _write_direct(self, path: str, parts: Sequence[memoryview]) -> bool:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL or self._direct == "on":
                raise
            self._note_direct(False, e)  # tmpfs and some FUSE mounts reject O_DIRECT
            return False
        tail: list[memoryview] = []
        try:
            for i, part in enumerate(parts):
                cut = len(part) - len(part) % _DIRECT_ALIGN
                _write_all(fd, part[:cut])
                if cut != len(part):
                    tail = [part[cut:], *parts[i + 1:]]
                    break
            self._note_direct(True, None)
            if self._fsync and not tail:  # O_DIRECT skips the cache, not the metadata journal
                os.fsync(fd)
        finally:
            os.close(fd)
        if tail:  # the unaligned remainder goes through the page cache
            self._write_fd(path, tail, os.O_WRONLY | os.O_APPEND)
        return True

    def _note_direct(self, works: bool, e: OSError | None) -> None:
        if self._direct_works is None:
            self._direct_works = works
            if not works:
                log.info("fastckpt: O_DIRECT not supported under %s (%s); using buffered writes", self.url, e)

    def _write_buffered(self, path: str, parts: Sequence[memoryview]) -> None:
        self._write_fd(path, parts, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

    def _write_fd(self, path: str, parts: Sequence[memoryview], flags: int) -> None:
        fd = os.open(path, flags, 0o644)
        try:
            for part in parts:
                _write_all(fd, part)
            if self._fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def write_atomic(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._write_buffered(tmp, [memoryview(data)])
            os.replace(tmp, path)  # atomic on POSIX: readers see old or new, never half
            if self._fsync:
                _fsync_dir(os.path.dirname(path))
        except OSError as e:
            _silent_remove(tmp)
            raise _wrap("committing", path, e) from e

    def write_file_atomic(self, path: str, parts: Sequence[memoryview]) -> None:
        # A hidden temporary name in the same folder: the rename is atomic and a reader of ``path`` sees the
        # previous file or the complete new one, never a torn one, even after SIGKILL (gc removes the temp).
        folder, base = os.path.split(path)
        tmp = os.path.join(folder, f".{base}.fastckpt-tmp-{os.getpid()}-{threading.get_ident()}")
        try:
            os.makedirs(folder, exist_ok=True)
            self._write_buffered(tmp, parts)
            os.replace(tmp, path)
            if self._fsync:
                _fsync_dir(folder)
        except OSError as e:
            _silent_remove(tmp)
            raise _wrap("writing", path, e) from e

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(offset)
                got = 0
                while got < len(out):
                    n = f.readinto(out[got:])
                    if not n:
                        raise EOFError(f"file ended after {offset + got} bytes")
                    got += n
        except (OSError, EOFError) as e:
            raise _wrap("reading", path, e) from e

    def map_file(self, path: str, size: int, readahead: bool = True) -> tuple[mmap.mmap, memoryview]:
        """Map ``path`` copy-on-write: tensors view the page cache, no read copy (local loads).

        ``readahead=False`` maps without starting to read (the remote tier maps files long before it reads them).
        """
        try:
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:
            raise _wrap("mapping", path, e) from e
        if readahead and hasattr(mmap, "MADV_WILLNEED"):
            mm.madvise(mmap.MADV_WILLNEED)  # start readahead of the whole file now
        return mm, memoryview(mm)

    def read_bytes(self, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError) as e:
            raise FileNotFoundError(e.errno, e.strerror, path) from e
        except OSError as e:
            raise _wrap("reading", path, e) from e

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return os.listdir(path)
        except FileNotFoundError:
            return []

    def delete(self, path: str) -> None:
        _silent_remove(path)

    def delete_tree(self, path: str) -> None:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def _aligned(parts: Sequence[memoryview]) -> bool:
    import numpy as np

    for part in parts[:-1]:
        if len(part) % _DIRECT_ALIGN:
            return False
    for part in parts:
        if len(part) and np.frombuffer(part, dtype=np.uint8).ctypes.data % _DIRECT_ALIGN:
            return False
    return True


def _write_all(fd: int, data: memoryview) -> None:
    while len(data):
        n = os.write(fd, data[: 1 << 30])
        data = data[n:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _silent_remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class FsspecStorage:
    """Any fsspec filesystem (s3://, memory://, gs://...). Object stores commit by PUT."""

    def __init__(self, url: str, storage_options: dict[str, Any], workers: int = 4) -> None:
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec is a hard dependency
            raise StorageError("fsspec is required for remote roots: pip install fsspec") from e
        try:
            fs, path = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as e:
            raise StorageError(f"no fsspec backend for {url!r}: {e}. For s3:// install fastckpt[s3] (s3fs)") from e
        except (ValueError, TypeError) as e:
            raise StorageError(f"cannot open storage {url!r}: {e}") from e
        self.fs = fs
        self._protocol = url.split("://", 1)[0]
        self.url = f"{self._protocol}://{path}" if "://" in url else path
        self._workers = workers

    def _p(self, path: str) -> str:
        return path.split("://", 1)[1] if "://" in path else path

    def join(self, *parts: str) -> str:
        return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        try:
            total = sum(len(p) for p in parts)
            if self._protocol in ("s3", "s3a") and total > 2 * _S3_PART:
                self._s3_multipart(self._p(path), parts)
                return
            with self.fs.open(self._p(path), "wb", block_size=64 << 20) as f:
                for part in parts:
                    f.write(part)
        except Exception as e:
            raise _wrap("uploading", path, e) from e

    def _s3_multipart(self, path: str, parts: Sequence[memoryview]) -> None:
        """One multipart upload whose parts go up concurrently (s3fs's file writer sends them one by one)."""
        import asyncio

        from fsspec.asyn import sync

        fs = self.fs
        bucket, key, _ = fs.split_path(path)

        async def upload() -> None:
            mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
            gate = asyncio.Semaphore(_S3_CONCURRENCY)

            async def one(number: int, piece: memoryview) -> dict[str, Any]:
                async with gate:  # at most _S3_CONCURRENCY bodies copied out at once
                    out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, PartNumber=number,
                                            UploadId=mpu["UploadId"], Body=bytes(piece))  # botocore wants bytes
                return {"PartNumber": number, "ETag": out["ETag"]}

            try:
                done = await asyncio.gather(*[one(i + 1, p) for i, p in enumerate(_pieces(parts, _S3_PART))])
                await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                                  MultipartUpload={"Parts": list(done)})
            except BaseException:
                await fs._abort_mpu(bucket, key, mpu["UploadId"])  # no orphaned parts billed forever
                raise

        sync(fs.loop, upload)
        fs.invalidate_cache(path)

    def write_atomic(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(self._p(path), data)  # one PUT: the object appears whole or not at all
        except Exception as e:
            raise _wrap("committing", path, e) from e

    def write_file_atomic(self, path: str, parts: Sequence[memoryview]) -> None:
        if self._protocol in _OBJECT_STORES:  # a PUT or a completed multipart upload appears whole
            self.write_file(path, parts)
            return
        folder, base = path.rsplit("/", 1) if "/" in path else ("", path)
        tmp = f"{folder}/.{base}.fastckpt-tmp-{os.getpid()}-{threading.get_ident()}"
        self.write_file(tmp, parts)
        try:
            self.fs.mv(self._p(tmp), self._p(path))
        except Exception as e:
            with contextlib.suppress(Exception):
                self.fs.rm_file(self._p(tmp))
            raise _wrap("renaming into", path, e) from e

    def read_into(self, path: str, offset: int, out: memoryview) -> None:
        pieces = [(s, min(s + _READ_PIECE, len(out))) for s in range(0, len(out), _READ_PIECE)]

        def fetch(piece: tuple[int, int]) -> None:
            start, end = piece
            data = self.fs.cat_file(self._p(path), start=offset + start, end=offset + end)
            if len(data) != end - start:
                raise EOFError(f"short read at {offset + start}: got {len(data)} of {end - start} bytes")
            out[start:end] = data

        try:
            if len(pieces) <= 1:
                for p in pieces:
                    fetch(p)
            else:  # concurrent ranged GETs: one connection rarely fills the link
                with ThreadPoolExecutor(self._workers, thread_name_prefix="fastckpt-read") as pool:
                    list(pool.map(fetch, pieces))
        except Exception as e:
            raise _wrap("reading", path, e) from e

    def read_bytes(self, path: str) -> bytes:
        with _backend_errors("reading", path, missing="raise"):
            return self.fs.cat_file(self._p(path))

    def size(self, path: str) -> int:
        with _backend_errors("stat of", path, missing="raise"):
            return int(self.fs.size(self._p(path)))

    def exists(self, path: str) -> bool:
        with _backend_errors("checking", path):
            self.fs.invalidate_cache(self._p(path))  # s3fs caches listings per instance
            return bool(self.fs.exists(self._p(path)))

    def listdir(self, path: str) -> list[str]:
        entries: list[str] = []
        with _backend_errors("listing", path, missing="ignore"):
            self.fs.invalidate_cache(self._p(path))
            entries = self.fs.ls(self._p(path), detail=False)
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def delete(self, path: str) -> None:
        with _backend_errors("deleting", path, missing="ignore"):
            self.fs.rm_file(self._p(path))

    def delete_tree(self, path: str) -> None:
        with _backend_errors("deleting", path, missing="ignore"):
            self.fs.rm(self._p(path), recursive=True)


@contextlib.contextmanager
def _backend_errors(op: str, path: str, missing: str = "wrap") -> Iterator[None]:
    """Turn a backend's exceptions into ``StorageError`` naming ``path``.

    ``missing`` decides about FileNotFoundError: ``raise`` it as is (callers test for absence),
    ``ignore`` it (deleting what is gone is fine), or ``wrap`` it like any other error.
    """
    try:
        yield
    except FileNotFoundError as e:
        if missing == "raise":
            raise
        if missing != "ignore":
            raise _wrap(op, path, e) from e
    except Exception as e:
        raise _wrap(op, path, e) from e


def _pieces(parts: Sequence[memoryview], size: int) -> list[memoryview]:
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


def open_storage(root: str, storage_options: dict[str, Any] | None = None, *, direct_io: str = "auto",
                 fsync: bool = True, workers: int = 4) -> Storage:
    """Local paths and ``file://`` get ``LocalStorage``; every other URL goes through fsspec."""
    if "://" not in root or root.startswith("file://"):
        return LocalStorage(root, direct_io=direct_io, fsync=fsync)
    return FsspecStorage(root, storage_options or {}, workers=workers)


def aligned_buffer(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    """A page-aligned anonymous buffer (usable for O_DIRECT)."""
    mm = mmap.mmap(-1, max(nbytes, 1))
    return mm, memoryview(mm)[:nbytes]
