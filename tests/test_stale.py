"""Stale-save detection (issue 25, item 3): a checkpoint whose parameters did not change although the watched
optimizer stepped gets one StaleCheckpointWarning; a normal run never does."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import torch

from fastckpt import CheckpointConfig, Checkpointer, StaleCheckpointWarning


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    opt.step()


def _caught(run) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run()
    return [w for w in seen if issubclass(w.category, StaleCheckpointWarning)]


def test_saving_a_copy_the_optimizer_no_longer_updates_warns_once(tmp_path: Path) -> None:
    model, opt = _setup()
    stale = copy.deepcopy(model)  # made once: the optimizer steps `model`, the saves see `stale`

    def run() -> None:
        with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
            ckpt.watch(opt)
            for step in range(4):
                _step(model, opt)
                ckpt.save({"model": stale.state_dict(), "optim": opt.state_dict()}, step)
            ckpt.wait()

    found = _caught(run)
    assert len(found) == 1, [str(w.message) for w in found]
    assert "'step-000000001'" in str(found[0].message) and "stepped 1 time(s)" in str(found[0].message)


def test_a_normal_run_never_warns(tmp_path: Path) -> None:
    model, opt = _setup()

    def run() -> None:
        with Checkpointer(CheckpointConfig(root=str(tmp_path / "a"))) as ckpt:
            ckpt.watch(opt)
            for step in range(4):
                _step(model, opt)
                ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, step)
            ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, 4)  # again, no step between
            ckpt.wait()
        with Checkpointer(CheckpointConfig(root=str(tmp_path / "b"))) as ckpt:  # the Lightning path: torch files
            ckpt.watch(opt)
            for step in range(3):
                _step(model, opt)
                ckpt.save_file({"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()]},
                               f"s{step}.ckpt", step=step)
            ckpt.wait()

    assert _caught(run) == []


def test_stale_torch_files_warn_too(tmp_path: Path) -> None:
    model, opt = _setup()
    frozen = {k: v.clone() for k, v in model.state_dict().items()}

    def run() -> None:
        with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
            ckpt.watch(opt)
            for step in range(3):
                _step(model, opt)
                ckpt.save_file({"state_dict": frozen, "optimizer_states": [opt.state_dict()]}, f"s{step}.ckpt",
                               step=step)
            ckpt.wait()

    assert len(_caught(run)) == 1


def test_the_warning_can_be_turned_off(tmp_path: Path) -> None:
    model, opt = _setup()
    stale = copy.deepcopy(model)

    def run() -> None:
        with Checkpointer(CheckpointConfig(root=str(tmp_path), health={"stale_warning": False})) as ckpt:
            ckpt.watch(opt)
            for step in range(3):
                _step(model, opt)
                ckpt.save({"model": stale.state_dict()}, step)
            ckpt.wait()

    assert _caught(run) == []
