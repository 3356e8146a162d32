"""A main-process step's result or error in a form every process can act on, and errors rebuilt across processes.

Steps such as picking the folder to load run on the main process only; the other processes are about to enter a
collective and must learn of a failure there, so the error travels as (class name, message) and is raised again,
as its own fastckpt class, on every process.
"""
from __future__ import annotations

import builtins
from dataclasses import dataclass
from typing import Any

import fastckpt.errors as errors
from fastckpt.errors import FastCkptError

__all__ = ["Outcome", "remote_error"]


@dataclass
class Outcome:
    """What a main-process-only step produced, in a form every process can act on."""

    value: Any = None
    error: FastCkptError | None = None

    @property
    def wire_error(self) -> tuple[str, str] | None:
        """The error as (class name, message): picklable for the collectives."""
        return None if self.error is None else (type(self.error).__name__, str(self.error))

    def raise_shared(self, wire_error: tuple[str, str] | None) -> None:
        """Raise on every process if the main one failed: the original error where it happened."""
        if self.error is not None:
            raise self.error
        if wire_error is not None:
            name, message = wire_error
            cls = getattr(errors, name, FastCkptError)
            if not (isinstance(cls, type) and issubclass(cls, FastCkptError)):
                cls = FastCkptError
            raise cls(f"on the main process: {message}")


def remote_error(rank: int, name: str, message: str) -> Exception:
    """The error another process raised, rebuilt here: its fastckpt or built-in class, else ``FastCkptError``."""
    cls = getattr(errors, name, None) or getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = FastCkptError
    try:
        return cls(f"on process {rank}: {message}")
    except TypeError:  # a class whose constructor wants more than a message
        return FastCkptError(f"on process {rank}: {name}: {message}")
