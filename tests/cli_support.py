"""Helpers shared by the tests/test_cli*.py files."""
from __future__ import annotations

import io
import struct
import threading
import zipfile
from multiprocessing.connection import Connection
from typing import Any

import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.storage.protocol import open_storage
from tests.helpers import WrappedStorage


def flip_record_byte(data: bytes) -> bytes:
    """``data`` (a torch zip file) with one byte flipped inside its first non-empty tensor record.

    The record's bytes start after its *local* header, whose extra field (torch's alignment padding)
    differs from the central directory's: read its lengths there.
    """
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26: info.header_offset + 30])
    out = bytearray(data)
    out[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0x10
    return bytes(out)


def state(step: int) -> dict[str, Any]:
    """A small state whose every value is a function of ``step`` (any process can rebuild it)."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"enc": {"w": torch.randn(8, 8, generator=g)}, "head.b": torch.randn(3, generator=g).bfloat16()},
            "optim": {"m": torch.randn(8, generator=g)}, "step": step}


class _HungStorage(WrappedStorage):
    """Every data write hangs: the snapshot lives only in shared memory until the process dies."""

    def write_file(self, path: str, parts: Any) -> None:
        threading.Event().wait()


def stage_then_hang(conn: Connection, root: str, options: dict[str, Any], shm: str, step: int) -> None:
    """Run in a child (``tests.shm_children.start``): stage ``state(step)`` in shared memory for ``root`` (its
    writes hang), report once staged, and wait for the parent's SIGKILL."""
    config = CheckpointConfig(root=root, storage_options=options, staging={"shm": True, "shm_dir": shm},
                              persist={"fsync": False})
    ckpt = Checkpointer(config, storage=_HungStorage(open_storage(root, options)))
    ckpt.save(state(step), step=step).wait_staged()
    conn.send(step)
    threading.Event().wait()
