"""Config values are checked on every assignment, not only at construction, and frozen once a Checkpointer holds
them; every refusal is a ``ConfigError`` naming the field (issue 22, item 12)."""
from __future__ import annotations

import copy
import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, ConfigError, StagingOptions
from tests.helpers import assert_bit_equal, bounded



def _target(cfg: CheckpointConfig, dotted: str) -> tuple[Any, str]:
    *sections, name = dotted.split(".")
    obj: Any = cfg
    for s in sections:
        obj = getattr(obj, s)
    return obj, name


# (field, bad value, what the message must say besides the field)
BAD = [
    ("staging.slots", 0, ">= 1"),
    ("staging.slots", "2", ">= 1"),
    ("staging.max_host_bytes", 0, ">= 1"),
    ("staging.mode", "bogus", "lazy, eager"),
    ("staging.when_busy", "never", "wait, skip"),
    ("staging.shm", "yes", "true or false"),
    ("staging.shm_dir", "", "directory"),
    ("persist.chunk_bytes", 0, ">= 4096"),
    ("persist.workers", 0, ">= 1"),
    ("persist.workers", -3, ">= 1"),
    ("persist.workers", True, ">= 1"),
    ("persist.verify_on_load", "no", "true or false"),
    ("persist.direct_io", "sometimes", "auto, on, off"),
    ("persist.priority", "high", "idle, low, normal"),
    ("retention.keep_last", 0, "null"),
    ("retention.keep_every_n_steps", -1, "null"),
    ("remote.workers", 0, ">= 1"),
    ("remote.url", "/backup/run", "fsspec URL"),
    ("remote.storage_options", [1], "mapping"),
    ("network.timeout_s", 0, "seconds"),
    ("network.retries", -1, ">= 0"),
    ("network.backoff_s", float("nan"), "seconds"),
    ("orphan_grace_s", -1, ">= 0"),
    ("orphan_grace_s", float("inf"), ">= 0"),
    ("root", 5, "path or URL"),
    ("root", "", "path or URL"),
    ("storage_options", "key=k", "mapping"),
    ("allowed_classes", ["nodot"], "module.QualName"),
    ("staging", None, "mapping or StagingOptions"),
    ("staging", 3, "mapping or StagingOptions"),
    ("persist", {"workers": 0}, "persist.workers"),
    ("staging", {"slot": 2}, "staging.slot"),
    ("staging.slot", 2, "not a config field"),  # a typo is not a setting
    ("rot", "/x", "not a config field"),
]


@pytest.mark.parametrize("dotted, value, says", BAD, ids=[f"{d}={v!r}" for d, v, _ in BAD])
def test_bad_assignment_is_refused_naming_the_field_and_changes_nothing(tmp_path, dotted, value, says) -> None:
    cfg = CheckpointConfig(root=str(tmp_path))
    before = cfg.to_dict()
    obj, name = _target(cfg, dotted)
    with pytest.raises(ConfigError) as ei:
        setattr(obj, name, value)
    assert dotted.split(".")[-1] in str(ei.value) and says in str(ei.value), str(ei.value)
    assert cfg.to_dict() == before  # refused: the old value stays
    assert CheckpointConfig.from_dict(cfg.to_dict()) == cfg


def test_good_assignments_are_checked_and_normalized(tmp_path) -> None:
    cfg = CheckpointConfig(root=str(tmp_path))
    cfg.staging = {"slots": 3, "mode": "eager"}  # a mapping becomes the section, checked
    assert isinstance(cfg.staging, StagingOptions) and cfg.staging.slots == 3 and cfg.staging.mode == "eager"
    cfg.persist.direct_io = False  # YAML's bare `off`
    assert cfg.persist.direct_io == "off"
    cfg.root = tmp_path / "sub"  # a Path is a path
    assert cfg.root == str(tmp_path / "sub")
    cfg.orphan_grace_s = None
    cfg.retention.keep_last = 2
    assert CheckpointConfig.from_dict(cfg.to_dict()) == cfg


def test_in_place_changes_are_caught_when_a_checkpointer_takes_the_config(tmp_path) -> None:
    cfg = CheckpointConfig(root=str(tmp_path))
    cfg.allowed_classes.append(5)  # a list changed in place: no assignment to check
    with pytest.raises(ConfigError, match="allowed_classes"):
        Checkpointer(cfg)
    assert not cfg.frozen
    same = CheckpointConfig(root="memory://fastckpt-t4-same", remote={"url": "memory://fastckpt-t4-other"})
    same.remote.url = "memory://fastckpt-t4-same/"  # the section alone cannot see root
    with pytest.raises(ConfigError, match="remote.url must differ from root"):
        Checkpointer(same)


def test_frozen_config_refuses_every_change_and_save_goes_on(tmp_path) -> None:
    """``cfg.staging.slots = 0`` after construction once made save() wait forever for a slot."""
    cfg = CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 8192})
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 1}
    with Checkpointer(cfg) as ckpt:
        assert cfg.frozen and cfg.staging.frozen
        for obj, name, value in [(cfg.staging, "slots", 0), (cfg.staging, "slots", 5), (cfg, "staging", None),
                                 (cfg.persist, "workers", 0), (cfg, "root", "/elsewhere"),
                                 (cfg.retention, "keep_last", 0)]:
            with pytest.raises(ConfigError, match=name):
                setattr(obj, name, value)
        assert cfg.staging.slots == 2 and cfg.persist.workers == 2
        bounded(lambda: ckpt.save(state, step=1).wait())
        assert_bit_equal(state, ckpt.load(step=1))
    # copies are new configs, unfrozen and checked
    for other in (dataclasses.replace(cfg, root=str(tmp_path / "b")), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert not other.frozen and not other.staging.frozen
        with pytest.raises(ConfigError, match="staging.slots"):
            other.staging.slots = 0
        other.staging.slots = 4
        assert other.staging.slots == 4 and cfg.staging.slots == 2


def test_a_section_shared_with_a_frozen_config_is_copied_not_frozen_twice(tmp_path) -> None:
    staging = StagingOptions(slots=3)
    a = CheckpointConfig(root=str(tmp_path / "a"), staging=staging)
    b = CheckpointConfig(root=str(tmp_path / "b"), staging=staging)
    with Checkpointer(a):
        assert staging.frozen
        with Checkpointer(b) as second:  # b's staging is a copy now: freezing it does not touch a's
            assert b.staging is not staging and b.staging.slots == 3 and second.config is b


# ---- the integrations: the same errors, never AttributeError/TypeError ----------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    ({"config": {"retention": [1]}}, "retention"),
    ({"config": {"retention": "x"}}, "retention"),
    ({"root": 5}, "root"),
    ({"config": {"staging": 5}, "staging": {"mode": "eager"}}, "staging"),
    ({"config": {"staging": None}}, "staging"),
    ({"persist": {"workers": 0}}, "persist.workers"),
    ({"config": {"persist": {"chunk_bytes": 0}}}, "persist.chunk_bytes"),
])
def test_lightning_plugin_refuses_with_config_error(kwargs, field) -> None:
    from fastckpt_lightning import FastCheckpointIO

    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        FastCheckpointIO(**kwargs)


def test_lightning_root_may_be_a_path(tmp_path) -> None:
    from fastckpt_lightning import FastCheckpointIO

    assert FastCheckpointIO(root=tmp_path / "ck").root == str(tmp_path / "ck")


@pytest.mark.parametrize("source, field", [
    ({"root": 5}, "root"),
    ({"retention": [1]}, "retention"),
    ({"retention": "x"}, "retention"),
    ({"staging": "abc"}, "staging"),
    ({"persist": {"workers": -1}}, "persist.workers"),
])
def test_accelerate_config_refuses_with_config_error(tmp_path, source, field) -> None:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from fastckpt_accelerate.config import resolve_config

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path), total_limit=2))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        resolve_config(source, accelerator)
    assert resolve_config({"root": Path(tmp_path) / "r"}, accelerator).root == str(tmp_path / "r")
