"""What a path on the command line is, and reading it without loading tensor bytes.

Kinds of one checkpoint:

* ``core``: a folder with fastckpt's ``manifest.json`` (also what the Accelerate integration writes);
* ``accelerate``: a ``checkpoint_N/`` folder of the files stock ``save_state`` writes;
* ``dcp``: a ``torch.distributed.checkpoint`` folder (it holds ``.metadata``);
* ``torch``: one ``torch.save`` file (a Lightning ``.ckpt`` is one);
* ``pointer``: a Lightning ``.ckpt`` of fastckpt 0.1's layout (a JSON pointer naming core folders).

Only torch's reader is used for torch files: reading a Lightning checkpoint never imports Lightning.
"""
from __future__ import annotations

import io
import json
import os
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Iterator

from ..errors import CheckpointNotFoundError, FastCkptError, IntegrityError
from ..format.manifest import MANIFEST, checkpoint_dir
from ..format.paths import confine, plain_name
from ..format.picklepeek import TensorStub, peek, scalar_value
from .. import LocalStorage, Storage, open_storage

__all__ = ["Located", "locate", "children", "kind_of", "read_skeleton", "pointer_parts", "pointer_step",
           "has_zip_end", "is_zip_start", "is_torch_name", "ACCELERATE_FILE", "accelerate_files", "accelerate_step",
           "checkpoint_bytes", "FileView"]

# The files stock Accelerate's save_state writes (model_1.safetensors, optimizer_1.bin... for more objects).
ACCELERATE_FILE = re.compile(r"(model|pytorch_model|optimizer|scheduler|sampler|dl_state_dict|scaler|"
                             r"random_states|custom_checkpoint)(_\d+)?\.(safetensors|bin|pt|pkl)")
_TORCH_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
_POINTER_FORMAT = "fastckpt-lightning-pointer"  # fastckpt_lightning/pointer.py: FORMAT
_MAX_POINTER_BYTES = 64 * 1024
_ZIP_END = b"PK\x05\x06"  # the end-of-central-directory signature: the last record torch writes


@dataclass(frozen=True, slots=True)
class Located:
    """A path opened for reading: the storage of its folder and the full path inside it."""

    storage: Storage
    path: str

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1]


def locate(path: str, options: dict[str, Any]) -> Located:
    """Open ``path`` (local or URL) through the storage of its parent folder; ``.../manifest.json`` names
    its checkpoint folder."""
    path = checkpoint_dir(path) or "/"
    if "://" in path and not path.startswith("file://"):
        parent = posixpath.dirname(path)
    else:
        path = os.path.abspath(path.removeprefix("file://"))
        parent = os.path.dirname(path)
    storage = open_storage(parent, options)
    return Located(storage, storage.join(storage.url, posixpath.basename(path)))


def children(loc: Located) -> list[str] | None:
    """The names in folder ``loc``; None if it is a file. A missing path raises ``CheckpointNotFoundError``."""
    storage, path = loc.storage, loc.path
    if isinstance(storage, LocalStorage):
        if os.path.isdir(path):
            return sorted(os.listdir(path))
        if os.path.isfile(path):
            return None
        if os.path.lexists(path):  # never opened: a FIFO would block the command, /dev/zero never end
            raise IntegrityError(f"{path} is not a regular file or a folder (a FIFO, a device, a socket or a dangling "
                                 "symbolic link): a checkpoint never is, so it is not read")
    else:
        names = storage.listdir(path)
        if names and names != [loc.name]:
            return sorted(names)
        if storage.exists(path):
            return None
    raise CheckpointNotFoundError(f"{path}: no such file or folder; check the path (and --storage-option for a URL)")


def kind_of(loc: Located) -> str:
    """``core``, ``accelerate``, ``dcp``, ``torch`` or ``pointer`` (see the module docstring)."""
    names = children(loc)
    if names is None:
        return "pointer" if pointer_parts(loc) is not None else "torch"
    # Checked before the manifest: fastckpt_accelerate's native folders hold stock Accelerate files plus a
    # manifest.json (layout "files") that lists them; a core checkpoint's shards never take those names.
    if any(ACCELERATE_FILE.fullmatch(n) for n in names):
        return "accelerate"
    if MANIFEST in names:
        return "core"
    if ".metadata" in names:
        return "dcp"
    raise IntegrityError(f"{loc.path}: not a checkpoint (no {MANIFEST}, no DCP .metadata, no Accelerate files); "
                         "pass a checkpoint folder or a .ckpt file")


def accelerate_files(loc: Located) -> Iterator[tuple[str, Located, str]]:
    """``(name, file, stem)`` of each stock Accelerate file in the folder ``loc`` (other names are not its)."""
    for name in children(loc) or []:
        if ACCELERATE_FILE.fullmatch(name):
            yield name, Located(loc.storage, loc.storage.join(loc.path, name)), name.rsplit(".", 1)[0]


def is_torch_name(name: str) -> bool:
    return name.endswith(_TORCH_SUFFIXES)


def pointer_parts(loc: Located) -> list[str] | None:
    """The core folders a fastckpt 0.1 pointer names (confined to its folder), or None if not a pointer."""
    if loc.storage.size(loc.path) > _MAX_POINTER_BYTES or _read_range(loc, 0, 1) != b"{":
        return None  # a torch file (or anything else): never read whole here
    try:
        body = json.loads(loc.storage.read_bytes(loc.path))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(body, dict) or body.get("format") != _POINTER_FORMAT:
        return None
    parts = body.get("parts")
    if not isinstance(parts, list):
        raise IntegrityError(f"{loc.path}: malformed fastckpt 0.1 pointer (parts {parts!r:.80})")
    folder = loc.path[: -len(loc.name) - 1]
    return [confine(folder, loc.storage.join(folder, plain_name(p, "data folder", loc.path)),
                    f"{loc.path}: data folder {p!r}") for p in parts]


def pointer_step(loc: Located) -> int | None:
    """The step a fastckpt 0.1 pointer records (call after ``pointer_parts`` found one)."""
    body = json.loads(loc.storage.read_bytes(loc.path))
    step = body.get("step")
    return step if type(step) is int else None


class _RangeReader(io.RawIOBase):
    """A seekable file over ``Storage.read_into``: torch's zip reader fetches only the records it needs."""

    def __init__(self, loc: Located) -> None:
        self._loc = loc
        self._size = loc.storage.size(loc.path)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._size - self._pos))
        if n:
            self._loc.storage.read_into(self._loc.path, self._pos, memoryview(b).cast("B")[:n])
            self._pos += n
        return n


def _read_range(loc: Located, offset: int, n: int) -> bytes:
    size = loc.storage.size(loc.path)
    n = max(0, min(n, size - offset))
    buf = bytearray(n)
    if n:
        loc.storage.read_into(loc.path, offset, memoryview(buf))
    return bytes(buf)


def is_zip_start(loc: Located) -> bool:
    """Whether the file starts as a zip does (its first local file header), as every torch zip file does."""
    return _read_range(loc, 0, 4) == b"PK\x03\x04"


def has_zip_end(loc: Located) -> bool:
    """Whether the file ends with a zip's end record: a torn (truncated) torch file does not."""
    size = loc.storage.size(loc.path)
    return size >= 22 and _read_range(loc, size - 22, 4) == _ZIP_END


def read_skeleton(loc: Located) -> Any:
    """A torch file's object tree with tensors of the right dtype and shape but unread bytes.

    ``torch.serialization.skip_data`` makes the loader skip every storage record, so only the pickle (and
    the zip directory) is fetched: cheap for a multi-GB ``.ckpt``, also on S3. ``weights_only`` as always.
    """
    import torch

    with torch.serialization.skip_data(), io.BufferedReader(_RangeReader(loc), 1 << 16) as f:
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises UnpicklingError, RuntimeError or ValueError for foreign files
            raise IntegrityError(f"{loc.path}: not a torch checkpoint readable with weights_only=True: "
                                 f"{(str(e).splitlines() or [type(e).__name__])[0]}") from e


def accelerate_step(loc: Located) -> int | None:
    """The training step of the Accelerate folder ``loc``: how many steps its optimizer took, as ``optimizer.bin``
    records it (the ``step`` count Adam, AdamW, RMSprop, Adagrad... keep with each parameter's state). None when the
    optimizer keeps no count (SGD) or the file is absent or unreadable: the step is then unknown, never guessed.

    Not ``Accelerator.step``, which stock saves in ``random_states_0.pkl``: that counts micro-batches for gradient
    accumulation, restarts at 0 at the end of each epoch's dataloader and stays 0 without ``accumulate()``. Read
    without torch (``format.picklepeek``): the pickle, then the few bytes of one tensor record.
    """
    file = Located(loc.storage, loc.storage.join(loc.path, "optimizer.bin"))
    try:
        view = FileView(file)
        tree = peek(view, file.path).tree
        state = tree.get("state") if isinstance(tree, dict) else None
        for param in (state.values() if isinstance(state, dict) else ()):
            step = param.get("step") if isinstance(param, dict) else None
            value = scalar_value(view, step) if isinstance(step, TensorStub) else step
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1 << 62:
                return int(value)
    except (FastCkptError, OSError):
        return None
    return None


class FileView:
    """``format.picklepeek.View`` over one file of a ``Storage``: its size, and reads of exact byte ranges."""

    def __init__(self, loc: Located) -> None:
        self._loc = loc
        self.size = loc.storage.size(loc.path)

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > self.size:
            raise IntegrityError(f"{self._loc.path}: a read of {n} bytes at offset {offset} runs past its "
                                 f"{self.size} bytes (truncated or malformed)")
        return _read_range(self._loc, offset, n)


def checkpoint_bytes(path: str, options: dict[str, Any]) -> int:
    """The bytes of the checkpoint at ``path`` (its files, a pointer's folders): the total progress counts to."""
    loc = locate(path, options)
    names = children(loc)
    if names is None:
        folders = pointer_parts(loc)
        if folders is None:
            return loc.storage.size(loc.path)
        return sum(checkpoint_bytes(f, options) for f in folders)
    total = 0
    for name in names:
        try:
            total += loc.storage.size(loc.storage.join(loc.path, name))
        except (OSError, FastCkptError):
            continue  # a sub-folder, or a file gone meanwhile: verify itself reports what matters
    return total
