"""Config validation names the field and the allowed values."""
from __future__ import annotations

import dataclasses

import pytest

from fastckpt import CheckpointConfig, ConfigError, RemoteOptions


def test_from_yaml_round_trip(tmp_path) -> None:
    p = tmp_path / "fastckpt.yaml"
    p.write_text("""
root: /data/run1
storage_options: {anon: false}
staging: {mode: eager, slots: 3, when_busy: skip, max_host_bytes: 1000000}
persist: {workers: 4, chunk_bytes: 65536, verify_on_load: false, direct_io: "off", fsync: false}
retention: {keep_last: 3, keep_every_n_steps: 100}
""")
    cfg = CheckpointConfig.from_yaml(p)
    assert cfg.staging.mode == "eager" and cfg.staging.slots == 3 and cfg.persist.workers == 4
    assert cfg.retention.keep_last == 3 and cfg.storage_options == {"anon": False}
    assert CheckpointConfig.from_dict(cfg.to_dict()) == cfg
    assert dataclasses.replace(cfg, root="/x").root == "/x"


@pytest.mark.parametrize("data, field, allowed", [
    ({"root": "/x", "staging": {"mode": "fast"}}, "staging.mode", "lazy, eager"),
    ({"root": "/x", "staging": {"when_busy": "drop"}}, "staging.when_busy", "wait, skip"),
    ({"root": "/x", "staging": {"slots": 0}}, "staging.slots", ">= 1"),
    ({"root": "/x", "persist": {"workers": "2"}}, "persist.workers", ">= 1"),
    ({"root": "/x", "persist": {"direct_io": "yes"}}, "persist.direct_io", "auto, on, off"),
    ({"root": "/x", "persist": {"verify_on_load": "no"}}, "persist.verify_on_load", "true or false"),
    ({"root": "/x", "persist": {"priority": "high"}}, "persist.priority", "idle, low, normal"),
    ({"root": "/x", "retention": {"keep_last": -1}}, "retention.keep_last", "null"),
    ({"root": "/x", "staging": {"slot": 2}}, "staging.slot", "allowed"),
    ({"root": "/x", "bogus": 1}, "bogus", "allowed top-level"),
    ({"staging": {}}, "root", "required"),
    ({"root": ""}, "root", "non-empty"),
    ({"root": "/x", "allowed_classes": ["nodot"]}, "allowed_classes", "module.QualName"),
    ({"root": "/x", "remote": {"url": "/backup/run1"}}, "remote.url", "fsspec URL"),
    ({"root": "/x", "remote": {"url": "file:///backup/run1"}}, "remote.url", "s3://"),
    ({"root": "/x", "remote": {"url": ""}}, "remote.url", "s3://bucket/run"),
    ({"root": "s3://b/run1", "remote": {"url": "s3://b/run1/"}}, "remote.url", "differ from root"),
    ({"root": "/x", "remote": {"url": "s3://b/r", "workers": 0}}, "remote.workers", ">= 1"),
    ({"root": "/x", "remote": {"url": "s3://b/r", "keep_last": 0}}, "remote.keep_last", "null"),
    ({"root": "/x", "remote": {"url": "s3://b/r", "storage_options": []}}, "remote.storage_options", "mapping"),
    ({"root": "/x", "remote": {"bucket": "b"}}, "remote.bucket", "allowed"),
])
def test_invalid_fields_are_named(data, field, allowed) -> None:
    with pytest.raises(ConfigError) as ei:
        CheckpointConfig.from_dict(data)
    assert field in str(ei.value) and allowed in str(ei.value)


def test_remote_section_round_trip(tmp_path) -> None:
    p = tmp_path / "fastckpt.yaml"
    p.write_text("""
root: /data/run1
retention: {keep_last: 2}
remote:
  url: s3://bucket/run1
  storage_options: {client_kwargs: {endpoint_url: "http://127.0.0.1:8333"}}
  workers: 8
  keep_last: 5
""")
    cfg = CheckpointConfig.from_yaml(p)
    assert cfg.remote == RemoteOptions(url="s3://bucket/run1", workers=8, keep_last=5,
                                       storage_options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:8333"}})
    assert cfg.to_dict()["remote"]["url"] == "s3://bucket/run1"
    assert CheckpointConfig.from_dict(cfg.to_dict()) == cfg
    default = CheckpointConfig(root="/x")
    assert default.remote == RemoteOptions() and default.remote.url is None and default.remote.workers == 4
    assert CheckpointConfig.from_dict(default.to_dict()) == default
    assert CheckpointConfig(root="/x", remote=RemoteOptions(url="memory://x")).remote.url == "memory://x"


def test_yaml_errors_name_the_file(tmp_path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("root: /x\npersist: {workers: 0}\n")
    with pytest.raises(ConfigError, match="bad.yaml.*persist.workers"):
        CheckpointConfig.from_yaml(p)
    with pytest.raises(ConfigError, match="cannot read"):
        CheckpointConfig.from_yaml(tmp_path / "missing.yaml")
