"""Helpers shared by the tests/test_accelerate*.py files: a tiny training setup, a gated storage, and the two
fixtures every such file uses (import them by name: ``from accelerate_testing import closing, fresh_accelerate``;
pytest finds fixtures in a module's namespace, and an imported autouse fixture applies to that module only)."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fastckpt import LocalStorage
from fastckpt.errors import FastCkptError


def reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; each test builds its Accelerator from scratch."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate() -> Any:
    """Accelerate's process-wide singletons reset before and after each test of a module that imports this."""
    reset_accelerate()
    yield
    reset_accelerate()


@pytest.fixture
def closing() -> Any:
    """A list the test appends each enabled ``FastAccelerateCheckpointing`` to; all are closed at teardown, even
    when the test failed (a background error at close is the test's own business, not the teardown's)."""
    opened: list = []
    yield opened
    for checkpointing in opened:
        try:
            checkpointing.close()
        except FastCkptError:
            pass


def make_accelerator(
    project_dir: Any, *, total_limit: int | None = None, automatic: bool = True, **kwargs: Any
) -> Accelerator:
    reset_accelerate()
    return Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=str(project_dir), automatic_checkpoint_naming=automatic, total_limit=total_limit
        ),
        **kwargs,
    )


class Counter:
    """An object for ``register_for_checkpointing``."""

    def __init__(self) -> None:
        self.value = 0
        self.history: list[int] = []

    def state_dict(self) -> dict:
        return {"value": self.value, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.history = state["value"], list(state["history"])


class Setup:
    """A prepared model (with BatchNorm and Dropout), AdamW, a scheduler, a dataloader and a counter."""

    def __init__(self, accelerator: Accelerator, width: int = 16, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.accelerator = accelerator
        model = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Dropout(0.2), nn.Linear(width, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        data = TensorDataset(torch.randn(64, width), torch.randn(64, 1))
        loader = DataLoader(data, batch_size=8, shuffle=True)
        prepared = accelerator.prepare(model, optimizer, scheduler, loader)
        self.model, self.optimizer, self.scheduler, self.loader = prepared
        self.counter = Counter()
        accelerator.register_for_checkpointing(self.counter)
        self.width = width

    def step(self) -> None:
        """One training step that mutates every part of the state (and consumes the RNGs)."""
        x = torch.randn(8, self.width)
        with self.accelerator.accumulate(self.model):
            loss = self.model(x).square().mean()
            self.accelerator.backward(loss)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad()
        self.counter.value += 1
        self.counter.history.append(int(self.counter.value))
        random.random()
        np.random.rand()

    def snapshot(self) -> dict:
        """Deep copies of everything save_state must capture."""
        acc = self.accelerator
        return clone(
            {
                "model": acc.unwrap_model(self.model).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "counter": self.counter.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "numpy_rng": np.random.get_state(),
                "python_rng": random.getstate(),
                "step": acc.step,
            }
        )


def clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    return obj


def assert_same(expected: Any, actual: Any, path: str = "") -> None:
    """Bit-exact equality of nested states (tensors with torch.equal, dtype included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{path}: {type(actual).__name__} is not a tensor"
        assert expected.dtype == actual.dtype and torch.equal(expected, actual), f"{path}: tensors differ"
    elif isinstance(expected, np.ndarray):
        assert np.array_equal(expected, np.asarray(actual)), f"{path}: arrays differ"
    elif isinstance(expected, dict):
        assert set(expected) == set(actual), f"{path}: keys {set(expected) ^ set(actual)} differ"
        for key in expected:
            assert_same(expected[key], actual[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), f"{path}: lengths differ"
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_same(e, a, f"{path}[{i}]")
    else:
        assert expected == actual, f"{path}: {expected!r} != {actual!r}"


class GatedStorage:
    """Local storage whose data-file writes wait for ``gate``: a storage as slow as the test wants."""

    def __init__(self, root: str) -> None:
        self._inner = LocalStorage(root, direct_io="off", fsync=False)
        self.url = self._inner.url
        self.gate = threading.Event()
        self.gate.set()
        self.write_started = threading.Event()

    def write_file(self, path: str, parts: Any) -> None:
        self.write_started.set()
        self.gate.wait()
        self._inner.write_file(path, parts)

    def write_file_atomic(self, path: str, parts: Any) -> None:  # the native format's files (fastckpt.format.bundle)
        self.write_started.set()
        self.gate.wait()
        self._inner.write_file_atomic(path, parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def rmtree_trials(tmp_path: Any, enable: Any, caplog: Any, trials: int = 20) -> None:
    """Accelerate's ``test_checkpoint_deletion`` pattern without ``TemporaryDirectory`` (which swallows
    ``FileNotFoundError``): ``total_limit=2``, six saves, a plain ``shutil.rmtree(project_dir)`` right after the last,
    ``trials`` times, with fastckpt turned on by ``enable(accelerator)``. The user's removal must win every time: no
    ``FileNotFoundError`` or "Directory not empty" from a name the background added or removed under the walk,
    nothing recreated, no error logged."""
    import logging
    import shutil

    caplog.set_level(logging.INFO, logger="fastckpt")
    failures: list[str] = []
    for trial in range(trials):
        project = tmp_path / f"project-{trial}"
        acc = make_accelerator(project, total_limit=2)
        enable(acc)
        setup = Setup(acc, seed=trial)
        for _ in range(6):
            setup.step()
            acc.save_state()
        try:
            shutil.rmtree(project)
        except OSError as e:
            failures.append(f"trial {trial}: {type(e).__name__}: {e}")
            shutil.rmtree(project, ignore_errors=True)
        acc.wait_for_everyone()
        acc.end_training()
        assert not project.exists(), f"trial {trial}: {project} recreated"
        del setup
    assert not failures, f"{len(failures)} of {trials} trials: " + "; ".join(failures[:3])
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors[0]
