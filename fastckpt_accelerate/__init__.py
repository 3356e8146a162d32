"""Asynchronous, fastckpt-backed ``Accelerator.save_state``/``load_state`` (local or s3://), exact resume."""

from .checkpointing import FastAccelerateCheckpointing
from .config import resolve_config
from .enable import enable, get_checkpointing

__all__ = ["FastAccelerateCheckpointing", "enable", "get_checkpointing", "resolve_config"]
