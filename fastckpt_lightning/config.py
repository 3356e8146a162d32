"""Turn the plugin's constructor arguments into one core ``CheckpointConfig``.

Lightning, not the config, decides where checkpoints go: every folder that ``ModelCheckpoint`` hands the plugin
gets its own core ``Checkpointer`` whose ``root`` is that folder. ``root`` in the config is therefore optional and
only serves as a default ``dirpath`` for :class:`~fastckpt_lightning.FastModelCheckpoint`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Mapping
from typing import Any, Optional, Union

from fastckpt import CheckpointConfig, RetentionOptions
from fastckpt.config import config_mapping
from fastckpt.errors import ConfigError

log = logging.getLogger(__name__)

ConfigSource = Union[CheckpointConfig, str, os.PathLike, Mapping[str, Any], None]

# The core requires a root; Lightning supplies the real folder per checkpoint, so any valid placeholder works.
_PLACEHOLDER_ROOT = "."


def build_config(source: ConfigSource, **overrides: Any) -> tuple[CheckpointConfig, Optional[str]]:
    """Merge ``source`` (a config, a YAML path or a dict) with keyword overrides; return the config and user root.
    A YAML file's settings refused are named with the file (``x.yaml: staging.mode must be ...``)."""
    base = config_mapping(source)  # names the file itself when it cannot be read or parsed
    try:
        return _build(base, overrides, source)
    except ConfigError as e:
        if not isinstance(source, (str, os.PathLike)):
            raise
        raise ConfigError(f"{os.fspath(source)}: {e}") from e


def _build(base: dict[str, Any], overrides: dict[str, Any], source: Any) -> tuple[CheckpointConfig, Optional[str]]:
    for key, value in overrides.items():
        if value is None:
            continue
        if isinstance(value, Mapping) and base.get(key) is not None:
            if not isinstance(base[key], Mapping):  # never let an override hide a broken section of the file
                raise ConfigError(f"{key} must be a mapping in the fastckpt config, got {type(base[key]).__name__}")
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    user_root = base.get("root")
    if user_root is None:
        base["root"] = _PLACEHOLDER_ROOT
    # A YAML file is shared by design (one schema for the core, Accelerate and Lightning): its retention serves the
    # others. Retention given to the plugin itself (the keyword, a dict, a CheckpointConfig) was meant for it.
    shared_file = isinstance(source, (str, os.PathLike)) and overrides.get("retention") is None
    base = _without_retention(base, source if shared_file else None)
    staging = base.get("staging")
    if "staging" not in base or (isinstance(staging, Mapping) and "on_mutation" not in staging):
        # Lightning's own hooks and callbacks write parameters outside step() (an EMA in on_train_batch_end, WGAN
        # clipping in training_step): such a checkpoint is taken again at the next step instead of failing fit.
        # (a section that is no mapping, `staging: null` included, stays as given: from_dict names the field)
        base["staging"] = {**(staging or {}), "on_mutation": "retake"}
    config = _without_shm(CheckpointConfig.from_dict(base))  # checks root (a path, not 5) and every section
    if config.remote.url is not None:
        # ModelCheckpoint's folder also holds the pointer files (`last.ckpt`, `epoch=...ckpt`) that name the
        # data; a remote copy of the data alone could not be resumed from with ckpt_path="last".
        raise ConfigError(
            f"remote.url={config.remote.url!r}: FastCheckpointIO does not use the remote tier. Point "
            "ModelCheckpoint(dirpath='s3://bucket/run') at the bucket instead (saves stay asynchronous, and "
            "pointers and data live together), or set remote.url: null for Lightning"
        )
    return config, (config.root if user_root is not None else None)


def for_directory(config: CheckpointConfig, dirpath: str) -> CheckpointConfig:
    """The config of the core ``Checkpointer`` that owns one Lightning checkpoint folder."""
    # The plugin handles preemption itself (fastckpt_lightning/preempt.py): per-folder Checkpointers must not.
    return dataclasses.replace(config, root=dirpath, preemption=dataclasses.replace(config.preemption, enabled=False))


def staging_mode(config: CheckpointConfig) -> str:
    """``"lazy"`` or ``"eager"``, read through ``to_dict`` so it does not depend on the nested dataclass layout."""
    return str((config.to_dict().get("staging") or {}).get("mode", "lazy"))


def _without_retention(config: dict[str, Any], shared_file: Optional[Union[str, os.PathLike]]) -> dict[str, Any]:
    # ModelCheckpoint(save_top_k=...) owns retention; core retention would delete data that pointers still name.
    retention = config.get("retention") or {}
    if not isinstance(retention, Mapping):
        raise ConfigError(f"retention must be a mapping, got {type(retention).__name__} (FastCheckpointIO ignores "
                          "it anyway: ModelCheckpoint(save_top_k=...) keeps the newest N)")
    defaults = RetentionOptions()
    chosen = {k: v for k, v in retention.items() if getattr(defaults, str(k), None) != v}  # the defaults choose nothing
    if chosen and shared_file is not None:
        log.info("fastckpt_lightning: %s's retention %s is for the core and Accelerate; FastCheckpointIO leaves "
                 "what is kept to ModelCheckpoint(save_top_k=...)", os.fspath(shared_file), chosen)
    elif chosen:
        warnings.warn(
            f"FastCheckpointIO ignores `retention` settings ({chosen}): use ModelCheckpoint(save_top_k=...) to keep "
            "the newest N.",
            UserWarning,
            stacklevel=4,
        )
    config.pop("retention", None)
    return config


def _without_shm(config: CheckpointConfig) -> CheckpointConfig:
    # The shared YAML may enable the shared-memory tier for the core and the Accelerate hook; Lightning's files are
    # single torch files (save_file), which that tier does not serve: turn it off here rather than fail every save.
    if not config.staging.shm:
        return config
    warnings.warn(
        "FastCheckpointIO ignores `staging.shm: true`: Lightning checkpoints are single torch files, which the"
        " shared-memory tier does not hold. They are written to ModelCheckpoint's dirpath as usual; set"
        " staging.shm: false in this config to silence this warning.",
        UserWarning,
        stacklevel=4,
    )
    return dataclasses.replace(config, staging=dataclasses.replace(config.staging, shm=False))
