"""Lifecycle safety: frozen configs, the root lock, garbage collection of dead saves, loads racing re-saves."""
from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, ConfigError


# ---- configs are frozen once a Checkpointer holds them -----------------------------------------------------


def test_mutating_a_config_in_use_raises_naming_the_field(tmp_path) -> None:
    cfg = CheckpointConfig(root=str(tmp_path), staging={"slots": 2})
    with Checkpointer(cfg) as ckpt:
        with pytest.raises(ConfigError, match=r"staging\.slots cannot change.*dataclasses\.replace"):
            cfg.staging.slots = 0
        with pytest.raises(ConfigError, match=r"retention\.keep_last cannot change"):
            cfg.retention.keep_last = 1
        with pytest.raises(ConfigError, match=r"^root cannot change"):
            cfg.root = str(tmp_path / "elsewhere")
        assert cfg.staging.slots == 2 and cfg.root == str(tmp_path)
        state = {"w": torch.randn(16, 16)}
        ckpt.save(state, step=1).wait(timeout=60)  # still consistent: save() commits
        assert torch.equal(ckpt.load()["w"], state["w"])


def test_copies_of_a_config_in_use_are_new_configs(tmp_path) -> None:
    cfg = CheckpointConfig(root=str(tmp_path / "a"))
    with Checkpointer(cfg):
        other = dataclasses.replace(cfg, root=str(tmp_path / "b"))  # the sections are copied too
        other.staging.slots = 3
        other.retention.keep_last = 2
        assert cfg.staging.slots == 2 and cfg.retention.keep_last is None
        for clone in (copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
            assert clone == cfg and not clone.frozen
            clone.staging.slots = 5
        with Checkpointer(other) as second:
            assert second.config.staging.slots == 3
            with pytest.raises(ConfigError, match=r"staging\.slots"):
                other.staging.slots = 1
    assert CheckpointConfig.from_dict(cfg.to_dict()) == cfg  # the flag is not part of the schema
