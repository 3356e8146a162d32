"""The shipped LightningCLI YAML builds FastCheckpointIO and checkpoints through it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
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


def _docs_commands() -> list[list[str]]:
    """The LightningCLI commands of docs/lightning.md, as argument lists after ``lightning_gpt.py``."""
    docs = (EXAMPLES.parent / "docs" / "lightning.md").read_text()
    lines = [line.split("#")[0].split() for line in docs.splitlines()
             if line.strip().startswith("python examples/lightning_gpt.py cli ")]
    assert len(lines) == 2, lines
    return [words[2:] for words in lines]


def test_cli_commands_from_the_docs_train_then_resume(tmp_path, capsys):
    """Issue 55, item 9: docs/lightning.md's "resume" command trained 0 steps and printed an empty stats table; its
    `--trainer.max_steps 200` command started from scratch and wrote last-v1.ckpt. The documented commands, as
    written (with a shorter run and private folders), train then continue; the mistakes are said, not silent."""
    config = yaml.safe_load((EXAMPLES / "lightning_cli.yaml").read_text())
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(tmp_path / "ckpt")
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    config["trainer"]["default_root_dir"] = str(tmp_path)
    config["trainer"]["max_steps"] = 4
    config["trainer"]["callbacks"][0]["init_args"]["every_n_train_steps"] = 2
    path = tmp_path / "cli.yaml"
    path.write_text(yaml.safe_dump(config))
    first, resume = _docs_commands()
    assert first[first.index("--config") + 1] == "examples/lightning_cli.yaml"
    assert resume[resume.index("--ckpt_path") + 1] == "last"
    assert int(resume[resume.index("--trainer.max_steps") + 1]) > 100  # beyond the shipped yaml's max_steps
    example = _load_example()

    def run(words: list[str]) -> str:
        words = [str(path) if w == "examples/lightning_cli.yaml" else w for w in words]
        words = ["8" if i and words[i - 1] == "--trainer.max_steps" else w for i, w in enumerate(words)]
        example.main([*words, "--trainer.enable_progress_bar=false"])
        return capsys.readouterr().out

    assert "stall" in run(first)
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 4
    with pytest.raises(SystemExit, match="holds last.ckpt of an earlier run; continue it with --ckpt_path last"):
        run(first)  # the first command again: refused, nothing written beside the first run's files
    assert not any(n.startswith("last-v") for n in os.listdir(tmp_path / "ckpt"))
    said = run([w for w in resume if w not in ("--trainer.max_steps", resume[resume.index("--trainer.max_steps") + 1])])
    assert "nothing to train: the run is at step 4 and --trainer.max_steps is 4" in said  # the same max_steps
    assert "stall" in run(resume)
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == 8
    assert not any(n.startswith("last-v") for n in os.listdir(tmp_path / "ckpt"))
