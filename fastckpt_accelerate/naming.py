"""Checkpoint names and URLs: Accelerate's ``checkpoint_{iteration}`` folders on local paths or fsspec URLs."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from fastckpt.errors import ConfigError

CHECKPOINT_PREFIX = "checkpoint_"
_NAME_RE = re.compile(r"checkpoint_(\d+)")


@dataclass(frozen=True, slots=True)
class CheckpointTarget:
    """Where one checkpoint lives: the Checkpointer root and the directory name under it."""

    root: str
    name: str

    @property
    def url(self) -> str:
        """The checkpoint directory (a local path or a URL)."""
        return join(self.root, self.name)


def checkpoint_name(iteration: int) -> str:
    """The folder name Accelerate's automatic naming gives to save number ``iteration``."""
    return f"{CHECKPOINT_PREFIX}{iteration}"


def iteration_from_name(name: str) -> int | None:
    """Parse ``checkpoint_12`` -> 12; None for names not made by automatic naming."""
    match = _NAME_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote or virtual filesystem (``s3://``, ``memory://``), not a local path."""
    return "://" in path and not path.startswith("file://")


def normalize(path: str | os.PathLike[str]) -> str:
    """A canonical spelling so that two spellings of one root compare equal."""
    text = os.fspath(path)
    if is_url(text):
        return text.rstrip("/")
    if text.startswith("file://"):
        text = text[len("file://"):]
    return os.path.abspath(os.path.expanduser(text))


def join(root: str, name: str) -> str:
    """``root/name`` for local paths and URLs alike (os.path.join would mangle ``s3://`` on Windows)."""
    return f"{root.rstrip('/')}/{name}" if is_url(root) else os.path.join(root, name)


def split(path: str | os.PathLike[str]) -> CheckpointTarget:
    """Split a checkpoint directory into its parent root and its name."""
    text = normalize(path)
    if is_url(text):
        root, _, name = text.rpartition("/")
        if not name or root.endswith(":/"):
            raise ConfigError(f"{text!r} has no parent folder; save into a folder such as {text}/run/checkpoint_0")
        return CheckpointTarget(root=root, name=name)
    return CheckpointTarget(root=os.path.dirname(text), name=os.path.basename(text))
