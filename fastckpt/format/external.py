"""A member of a ``FileBundle`` that another save writes: the bundle only waits for it and records it.

Accelerate's folder on S3 with several processes: every process uploads its parts of ``model.safetensors`` and
``optimizer.bin`` (``save_file`` with ``distributed=True``), while the main process's bundle writes the small
files and the manifest. The bundle's member for such a file is an ``ExternalFile``: at the commit it waits for
that save (``wait`` returns the committed file's size and CRC32C, or raises its error), so the manifest, the
folder's commit point, is written only once every file in it is, and lists each with its real size and CRC32C.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import IntegrityError
from .layout import FileRecord

__all__ = ["EXTERNAL", "ExternalFile"]

EXTERNAL = "external"  # FileBundle.plan's kind: ``(EXTERNAL, wait)``, ``wait() -> (size, crc32c)``


@dataclass(eq=False)
class ExternalFile:
    """A file of the folder written by another save; the bundle stages nothing for it."""

    path: str
    wait: Callable[[], tuple[int, int | None]]
    size: int = 0  # nothing of it is staged by the bundle

    def parts(self, views: object, crcs: object) -> list[memoryview]:
        return []

    def record(self, name: str) -> FileRecord:
        """Block until the other save committed the file (raising its error if it failed); its record."""
        size, crc = self.wait()
        if crc is None:  # a manifest must never list a CRC32C it does not know: a reader would refuse the file
            raise IntegrityError(f"{self.path}: its save did not report the file's CRC32C; the folder's manifest "
                                 "cannot list it, so the checkpoint is not committed")
        return FileRecord(name, size, crc)
