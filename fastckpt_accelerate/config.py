"""Build the core ``CheckpointConfig`` for an Accelerator from fastckpt's own YAML schema.

The schema is exactly the core's (see docs/API.md), in its own file: Accelerate's ``accelerate config``
YAML rejects unknown keys. Two things come from the Accelerator when the file leaves them out:

- ``root`` defaults to ``{project_dir}/checkpoints``, where Accelerate's automatic naming saves (``./checkpoints``
  without a project_dir; nothing is created there unless a save uses it);
- ``retention.keep_last`` defaults to ``ProjectConfiguration.total_limit``.

A ``root`` in the file wins over ``project_dir``, with one warning where automatic naming would otherwise save
elsewhere.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Union

from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from fastckpt import CheckpointConfig
from fastckpt.config import config_mapping
from fastckpt.errors import ConfigError

from .naming import normalize

logger = logging.getLogger(__name__)

ConfigSource = Union[CheckpointConfig, dict, str, os.PathLike, None]


def resolve_config(source: ConfigSource, accelerator: Accelerator) -> CheckpointConfig:
    """A validated ``CheckpointConfig`` from a config object, a dict, a YAML path, or None (all defaults). A YAML
    file's settings refused are named with the file (``x.yaml: staging.mode must be ...``)."""
    raw = config_mapping(source)  # names the file itself when it cannot be read or parsed
    try:
        return _resolve(raw, accelerator)
    except ConfigError as e:
        if not isinstance(source, (str, os.PathLike)):
            raise
        raise ConfigError(f"{os.fspath(source)}: {e}") from e


def _resolve(raw: dict[str, Any], accelerator: Accelerator) -> CheckpointConfig:
    project = accelerator.project_configuration
    root = raw.get("root")
    given = not (root is None or root == "")
    if not given:
        root = _default_root(project.project_dir)
    if isinstance(root, os.PathLike):
        root = os.fspath(root)
    if isinstance(root, str):  # anything else (root: 5) is refused by CheckpointConfig, naming root
        # One spelling per root, so that save_state(output_dir) under the root reuses its Checkpointer.
        root = normalize(root)
        if given:
            _warn_if_elsewhere(root, project)
    raw["root"] = root
    total_limit = project.total_limit
    if total_limit is not None and isinstance(raw.get("retention") or {}, Mapping):  # else refused below
        retention = dict(raw.get("retention") or {})
        keep_last = retention.get("keep_last")
        if keep_last is None:
            retention["keep_last"] = total_limit
        elif keep_last != total_limit:
            logger.warning(
                "fastckpt retention.keep_last=%s overrides ProjectConfiguration.total_limit=%s", keep_last, total_limit
            )
        raw["retention"] = retention
    staging = raw.get("staging")
    if "staging" not in raw or (isinstance(staging, Mapping) and "on_mutation" not in staging):
        # Parameters written outside step() (an EMA in the loop, weight clipping): such a checkpoint is taken again
        # at the next step instead of failing the run (docs/accelerate.md, "Writes outside step()").
        staging = raw["staging"] = {**(staging or {}), "on_mutation": "retake"}
    if isinstance(staging, Mapping) and staging.get("shm"):
        # The YAML is shared with the core and Lightning: the shared-memory tier holds core checkpoints only, so
        # turn it off here (with one warning) rather than refuse a config that serves the other users.
        warnings.warn(
            "fastckpt_accelerate ignores `staging.shm: true`: Accelerate's native folders are written to disk "
            "directly, the shared-memory tier does not hold them; set staging.shm: false in this config to "
            "silence this warning.",
            UserWarning,
            stacklevel=_user_stacklevel(),
        )
        raw["staging"] = {**staging, "shm": False}
    return CheckpointConfig.from_dict(raw)


def _warn_if_elsewhere(root: str, project: ProjectConfiguration) -> None:
    """Say once (per ``enable``) that the config's ``root`` takes the checkpoints away from ``project_dir``, where
    stock Accelerate's automatic naming puts them, as the Lightning plugin says when its ``root`` and a
    ``ModelCheckpoint``'s ``dirpath`` differ. Silent where they agree, or where no project_dir is set (the root is
    then the only place named)."""
    if not project.automatic_checkpoint_naming or project.project_dir is None:
        return
    stock = _default_root(project.project_dir)
    if normalize(stock) == root:
        return
    warnings.warn(
        f"fastckpt's root {root!r} (from the fastckpt config) overrides ProjectConfiguration(project_dir="
        f"{project.project_dir!r}): save_state() puts its checkpoint_N folders under {root!r}, not under {stock!r} "
        "as stock Accelerate would. Leave root out of the fastckpt config to keep them under project_dir, or leave "
        "project_dir out.",
        UserWarning,
        stacklevel=_user_stacklevel(),
    )


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's line (the ``enable(...)`` call), however many of this
    package's frames lie between: a fixed number broke once already when a wrapper was added."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    return level


def _default_root(project_dir: str | None) -> str:
    if project_dir is None:
        # save_state(output_dir) needs no root (the folder's parent is used); automatic naming without a
        # project_dir, which stock Accelerate refuses, saves under ./checkpoints.
        return os.path.abspath("checkpoints")
    return os.path.join(os.path.abspath(os.path.expanduser(project_dir)), "checkpoints")
