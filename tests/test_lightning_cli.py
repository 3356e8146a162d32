"""The shipped LightningCLI YAML builds FastCheckpointIO and checkpoints through it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
import yaml


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load_example():
    spec = importlib.util.spec_from_file_location("lightning_gpt", EXAMPLES / "lightning_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_yaml_uses_fastckpt(tmp_path, capsys):
    config = yaml.safe_load((EXAMPLES / "lightning_cli.yaml").read_text())
    # Only where files go, and how long it runs, change; the plugin section is used as shipped.
    config["trainer"]["max_steps"] = 4
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    config["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    config["trainer"]["default_root_dir"] = str(tmp_path)
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(config))
    example = _load_example()

    example.main(["cli", "fit", "--config", str(path), "--trainer.enable_progress_bar=false"])

    assert "stall" in capsys.readouterr().out
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert files[-1] == "last.ckpt" and len(files) == 3
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 4


def test_cli_resume_command_from_the_docs_continues(tmp_path, capsys):
    """docs/lightning.md: `... cli fit --config ... --ckpt_path last` resumes (here with more max_steps)."""
    config = yaml.safe_load((EXAMPLES / "lightning_cli.yaml").read_text())
    config["trainer"]["max_steps"] = 2
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    config["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    config["trainer"]["default_root_dir"] = str(tmp_path)
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(config))
    docs = (EXAMPLES.parent / "docs" / "lightning.md").read_text()
    assert "cli fit --config examples/lightning_cli.yaml --ckpt_path last" in docs
    example = _load_example()
    common = ["cli", "fit", "--config", str(path), "--trainer.enable_progress_bar=false"]

    example.main(common)
    example.main([*common, "--ckpt_path", "last", "--trainer.max_steps", "4"])

    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 4
