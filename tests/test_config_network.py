"""Config fields of the storage slice: network deadlines, ``~`` in root, YAML on/off for direct_io."""
from __future__ import annotations

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, ConfigError, NetworkOptions


def test_tilde_in_root_is_the_home_directory(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert CheckpointConfig(root="~/ckpts").root == str(tmp_path / "home" / "ckpts")
    assert CheckpointConfig(root="file://~/ckpts").root == f"file://{tmp_path / 'home' / 'ckpts'}"
    assert CheckpointConfig(root="s3://b/~x").root == "s3://b/~x"  # a URL is left alone
    w = torch.arange(6, dtype=torch.float32)
    with Checkpointer(CheckpointConfig(root="~/ckpts")) as ckpt:
        ckpt.save({"w": w}, step=1).wait()
    assert (tmp_path / "home" / "ckpts" / "step-000000001" / "manifest.json").is_file()
    assert not (tmp_path / "~").exists()  # no literal "~" directory in the working directory
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "home" / "ckpts"))) as again:
        assert torch.equal(again.load()["w"], w)


@pytest.mark.parametrize(("word", "mode"), [("on", "on"), ("off", "off"), ("auto", "auto"), ("yes", "on")])
def test_yaml_on_off_for_direct_io(tmp_path, word, mode) -> None:
    path = tmp_path / "fastckpt.yaml"
    path.write_text(f"root: {tmp_path / 'ck'}\npersist:\n  direct_io: {word}\n")
    assert CheckpointConfig.from_yaml(path).persist.direct_io == mode


def test_network_options_defaults_and_validation() -> None:
    cfg = CheckpointConfig.from_dict({"root": "/tmp/x", "network": {"timeout_s": 2.5, "retries": 0}})
    assert cfg.network == NetworkOptions(timeout_s=2.5, retries=0, backoff_s=1.0)
    assert CheckpointConfig(root="/tmp/x").network.timeout_s == 60.0
    assert CheckpointConfig.from_dict(cfg.to_dict()) == cfg
    for bad, field in [({"timeout_s": 0}, "network.timeout_s"), ({"timeout_s": float("inf")}, "network.timeout_s"),
                       ({"timeout_s": True}, "network.timeout_s"), ({"retries": -1}, "network.retries"),
                       ({"backoff_s": "1"}, "network.backoff_s"), ({"deadline": 3}, "network.deadline")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            CheckpointConfig.from_dict({"root": "/tmp/x", "network": bad})
