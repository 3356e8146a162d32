"""Exception types. Every error fastckpt raises is a ``FastCkptError``.

Subclasses also derive from the closest built-in so callers that already catch
``ValueError``/``OSError``/``FileNotFoundError`` keep working.
"""
from __future__ import annotations

__all__ = [
    "FastCkptError",
    "ConfigError",
    "StorageError",
    "CheckpointTimeoutError",
    "MissingCredentialsError",
    "IntegrityError",
    "CheckpointNotFoundError",
    "StateMismatchError",
    "UnsafeCheckpointError",
    "SnapshotMutatedError",
    "StaleCheckpointWarning",
    "RetakenSnapshotWarning",
]


class FastCkptError(Exception):
    """Base class of every fastckpt error."""


class ConfigError(FastCkptError, ValueError):
    """A configuration field is missing or has an invalid value."""


class StorageError(FastCkptError, OSError):
    """Reading or writing the checkpoint storage failed (disk full, permission, network)."""


class FolderRemovedError(StorageError):
    """The folder a pending save was writing was removed by someone else (a ``TemporaryDirectory`` cleanup, a
    cleanup script): the save is abandoned, nothing is recreated, and it is not raised at the next save, ``wait`` or
    ``close`` (a warning says so once); only ``handle.wait()`` of that very save raises it."""


class MissingCredentialsError(StorageError):
    """An object store's client found no credentials (botocore's ``NoCredentialsError`` and its kin), said with what
    to set instead of the client's bare "Unable to locate credentials"."""

    _CAUSES = frozenset({"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"})

    @classmethod
    def caused(cls, error: BaseException) -> bool:
        """Whether ``error``, or an error it was raised from (or during), is a client's missing-credentials error."""
        seen: set[int] = set()
        current: BaseException | None = error
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            if {c.__name__ for c in type(current).__mro__} & cls._CAUSES:
                return True
            current = current.__cause__ or current.__context__
        return False

    @staticmethod
    def fix(where: str = "the storage options (storage_options in Python or YAML; --storage-option key=... "
                         "--storage-option secret=... on the command line)") -> str:
        """The sentence that says what to set, ``where`` naming the options that reach this client."""
        return (f"no S3 credentials were found: set key and secret in {where}, or the AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY variables (or AWS_PROFILE)")


class CheckpointTimeoutError(StorageError, TimeoutError):
    """A storage request, ``wait(timeout)`` or ``close(timeout)`` ran past its deadline; the message names
    what was still pending."""


class IntegrityError(FastCkptError):
    """A checkpoint file is corrupt, truncated or not a fastckpt file."""


class CheckpointNotFoundError(FastCkptError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class StateMismatchError(FastCkptError, ValueError):
    """The saved state does not match the target it is loaded into."""


class UnsafeCheckpointError(IntegrityError):
    """The checkpoint holds an object that the safe loader refuses to rebuild."""


class SnapshotMutatedError(FastCkptError):
    """A lazily copied tensor changed between ``save()`` and its copy; use ``staging.mode: eager``."""


class StaleCheckpointWarning(UserWarning):
    """A checkpoint's parameters are bit-identical to the previous checkpoint's although a watched optimizer
    stepped in between: the state saved is not the one being trained (a copy of the model made once, a
    reference to a state the optimizer no longer updates). Raised as a warning, once per ``Checkpointer``."""


class RetakenSnapshotWarning(UserWarning):
    """A lazy snapshot was refused at its seal (a tensor changed after ``save()`` returned and before the next
    optimizer step: an EMA updated through ``.data``, weight clipping, a swap) and taken again, whole, at the seal
    (``staging.on_mutation: retake``, the Lightning and Accelerate default): that checkpoint holds the values of the
    seal, not of ``save()``. The tensors named are copied inside ``save()`` from then on. Once per process; filter
    it (``warnings.filterwarnings("ignore", category=RetakenSnapshotWarning)``) or make it an error as any warning."""
