"""The shipped LightningCLI YAML builds FastCheckpointIO and checkpoints through it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import yaml

from fastckpt_lightning.pointer import read_pointer

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

    assert "weights shared" in capsys.readouterr().out
    pointers = [name for name in os.listdir(tmp_path / "ckpt") if read_pointer(str(tmp_path / "ckpt" / name))]
    assert sorted(pointers)[-1] == "last.ckpt" and len(pointers) == 3
