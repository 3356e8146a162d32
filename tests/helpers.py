"""Shared test helpers: bit-exact comparison and storages that fail or stall on demand."""
from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from fastckpt.storage.protocol import Storage


def s3_uploads(fs: Any, url: str) -> list[dict]:
    """The multipart uploads in progress under ``url`` (``s3://bucket/prefix``) on the s3fs filesystem ``fs``."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])


def _where_differ(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two flat tensors of one dtype differ, and by how much: a stale or later write (a whole step's change,
    in one region) reads differently from a last-bit difference (two processes' arithmetic)."""
    ab, bb = a.view(torch.uint8).reshape(-1, a.element_size()), b.view(torch.uint8).reshape(-1, b.element_size())
    bad = (ab != bb).any(dim=1).nonzero().reshape(-1)
    first, last = int(bad[0]), int(bad[-1])
    text = f"{bad.numel()} of {a.numel()} elements, indices {first}..{last}; first: {a[first].item()!r} vs " \
           f"{b[first].item()!r}"
    if a.is_floating_point():
        text += f"; max |difference| {(a.double() - b.double()).abs().nan_to_num(0.0).max().item():.3g}"
    return text


def assert_bit_equal(a: Any, b: Any, path: str = "state") -> None:
    """Recursively compare two states; tensors must match bit for bit (NaNs included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: expected a tensor, got {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        ac, bc = a.detach().cpu().contiguous().reshape(-1), b.detach().cpu().contiguous().reshape(-1)
        if ac.numel() and ac.view(torch.uint8).numpy().tobytes() != bc.view(torch.uint8).numpy().tobytes():
            raise AssertionError(f"{path}: tensor bytes differ: {_where_differ(ac, bc)}")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), f"{path}: array bytes differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{path}: expected dict, got {type(b).__name__}"
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_bit_equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bit_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, f"{path}: NaN lost"
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} vs {b!r}"


def clone_state(obj: Any) -> Any:
    """A deep copy with tensors cloned (the reference values at save time)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, clone_state(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if type(obj) is tuple:
        return tuple(clone_state(v) for v in obj)
    return obj


class KeepsItsBuffers(torch.optim.AdamW):
    """Loads a state into the tensors it already holds, as optimizers with preallocated (flat) buffers do, instead
    of rebinding ``self.state`` to the loaded tensors as torch's own ``load_state_dict`` does: a load that writes in
    place what a pending lazy copy may still read."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        held = {p: dict(s) for p, s in self.state.items()}
        super().load_state_dict(state_dict)
        with torch.no_grad():
            for p, s in self.state.items():
                for k, v in s.items():
                    old = held.get(p, {}).get(k)
                    if isinstance(old, torch.Tensor) and old.shape == v.shape:
                        old.copy_(v)
                        s[k] = old


class WrappedStorage:
    """Delegates everything to ``inner``; subclasses override what they fault."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.url = inner.url

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        self.inner.write_file(path, parts)

    def write_atomic(self, path: str, data: bytes) -> None:
        self.inner.write_atomic(path, data)


class FaultyStorage(WrappedStorage):
    """Fails the ``fail_on``-th data write (1-based) after writing part of it, like a full disk."""

    def __init__(self, inner: Storage, fail_on: int = 1, err: int = errno.ENOSPC) -> None:
        super().__init__(inner)
        self.fail_on = fail_on
        self.err = err
        self.writes = 0
        self.armed = True
        self._lock = threading.Lock()

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        with self._lock:
            self.writes += 1
            fail = self.armed and self.writes == self.fail_on
        if fail:
            self.inner.write_file(path, [parts[0][: max(1, len(parts[0]) // 2)]])  # a torn file stays behind
            raise OSError(self.err, f"injected: {errno.errorcode[self.err]}", path)
        self.inner.write_file(path, parts)


class GatedStorage(WrappedStorage):
    """Blocks every data write until ``gate`` is set; ``entered`` fires when a write is waiting."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.deleted: list[str] = []

    def write_file(self, path: str, parts: Sequence[memoryview]) -> None:
        self.entered.set()
        self.gate.wait(timeout=60)
        self.inner.write_file(path, parts)

    def delete(self, path: str) -> None:
        self.deleted.append(path)
        self.inner.delete(path)


def listed(root: Any) -> list[str]:
    """The sorted entries of a local root, without fastckpt's own dotfiles (the root lock)."""
    return sorted(n for n in os.listdir(root) if not n.startswith("."))


def drop_page_cache(path: Any) -> None:
    """Evict the file ``path`` from the page cache: the next read of it is cold (the benchmarks' own way)."""
    from benchmarks.measure import drop_file_cache

    drop_file_cache(path)


CHILD_AS_BYTES = 8 << 30  # torch's own mappings fit; a read of /dev/zero or a runaway allocation does not
CHILD_TIMEOUT_S = 120  # a safety net: a child answers in seconds, or it hangs for ever without the fix


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` (argv: ``args``) in a fresh interpreter importing this worktree first, under RLIMIT_AS and a
    timeout: for anything that could hang (a FIFO) or allocate without end (``/dev/zero``). A hang fails the test."""
    import pytest

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS_BYTES, CHILD_AS_BYTES))

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    try:
        return subprocess.run([sys.executable, "-c", code, *args], env=env, preexec_fn=limit, capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child hung for {CHILD_TIMEOUT_S}s (stdout {e.stdout!r}, stderr {e.stderr!r})")



def bounded(fn: Callable[[], Any], timeout: float = 60.0) -> Any:
    """``fn()`` on a daemon thread; its result (or exception), or ``TimeoutError`` when it has not returned within
    ``timeout``: a regression that hangs fails its test instead of hanging the suite."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            fut.set_exception(e)

    threading.Thread(target=run, name="bounded", daemon=True).start()
    try:
        return fut.result(timeout)
    except TimeoutError:
        if fut.done():
            raise  # fn itself raised a TimeoutError: its own, as it is
        raise StillBlocked(f"still blocked after {timeout}s") from None


class StillBlocked(TimeoutError):
    """``bounded``'s function had not returned in time (a ``TimeoutError`` it raised itself stays what it is)."""


def assert_same_torch_file(data: bytes, other: bytes) -> None:
    """``data`` is the torch file ``other`` byte for byte: the same size, the same records in the same order with the
    same bytes (the serialization id aside: torch draws a new one per save)."""
    import io
    import zipfile

    assert len(data) == len(other)
    with zipfile.ZipFile(io.BytesIO(data)) as ours, zipfile.ZipFile(io.BytesIO(other)) as theirs:
        assert ours.testzip() is None, "every record's CRC-32 is filled in and right"
        assert [(i.filename, i.header_offset, i.file_size) for i in ours.infolist()] == \
            [(i.filename, i.header_offset, i.file_size) for i in theirs.infolist()]
        for name in ours.namelist():
            if not name.endswith("serialization_id"):
                assert ours.read(name) == theirs.read(name), name
