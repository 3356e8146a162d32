"""Asynchronous, fastckpt-backed ``Accelerator.save_state``/``load_state`` (local or s3://), exact resume."""

from .cadence import cadence_stats, should_checkpoint
from .checkpointing import FastAccelerateCheckpointing
from .config import resolve_config
from .enable import enable, get_checkpointing
from .loadstats import LoadStateStats

__all__ = ["FastAccelerateCheckpointing", "LoadStateStats", "cadence_stats", "enable", "get_checkpointing",
           "resolve_config", "should_checkpoint"]
