"""What saves, loads (issue 23, item 6).

Accelerate: a registered object holding numpy arrays resumes bit for bit through fastckpt and through stock, both
ways; a state ``load_state`` would refuse fails the save (on the committer, logged then, raised by ``wait()``),
naming the file and the key, and never commits. The core: an allowlisted object holding numpy arrays saves and
loads, and a save leaves the user's own ``torch.serialization`` safe globals as they were.
"""

from __future__ import annotations

import datetime
import logging
import os
from fractions import Fraction

import numpy as np
import pytest
import torch

import fastckpt_accelerate
from accelerate_testing import Setup, closing, fresh_accelerate, make_accelerator  # noqa: F401 (fixtures)
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.errors import UnsafeCheckpointError

pytestmark = pytest.mark.timeout(120)


class Arrays:
    """A registered object whose state holds numpy arrays and scalars of every common kind, and a tensor."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.state = {
            "f32": rng.standard_normal((3, 4)).astype(np.float32), "f64": rng.standard_normal(5),
            "i64": rng.integers(-9, 9, 6), "u32": rng.integers(0, 2**32 - 1, 4, dtype=np.uint32),
            "u8": rng.integers(0, 255, 3, dtype=np.uint8), "bool": rng.random(4) > 0.5,
            "c64": (rng.standard_normal(2) + 1j * rng.standard_normal(2)).astype(np.complex64),
            "f16": rng.standard_normal(3).astype(np.float16), "when": np.array(["2024-01-02"], dtype="datetime64[D]"),
            "scalar": np.float64(rng.standard_normal()), "int": np.int32(seed), "tensor": torch.randn(3),
            "nested": [{"a": np.arange(4, dtype=np.int16)}],
        }

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def _same(expected: dict, actual: dict) -> None:
    assert set(expected) == set(actual)
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, torch.Tensor):
            assert torch.equal(want, got) and want.dtype == got.dtype, key
        elif isinstance(want, list):
            np.testing.assert_array_equal(want[0]["a"], got[0]["a"])
            assert want[0]["a"].dtype == got[0]["a"].dtype
        else:
            assert type(want) is type(got) and want.dtype == got.dtype, key
            assert np.asarray(want).tobytes() == np.asarray(got).tobytes(), key  # bit for bit


def _accelerator(tmp_path, closing, name: str, **enable):
    acc = make_accelerator(tmp_path / name, automatic=False)
    setup = Setup(acc)
    closing.append(fastckpt_accelerate.enable(acc, **enable))
    return acc, setup


def test_a_registered_numpy_object_resumes_bit_exact_through_fastckpt_and_stock(tmp_path, closing):
    acc, setup = _accelerator(tmp_path, closing, "a")
    saved = Arrays(1)
    acc.register_for_checkpointing(saved)
    setup.step()
    ours = acc.save_state(str(tmp_path / "ours"))
    closing[-1].wait()
    assert os.path.exists(os.path.join(ours, "manifest.json"))
    stock = str(tmp_path / "stock")
    type(acc).save_state(acc, stock)  # Accelerate's own writer

    for folder, load in ((ours, acc.load_state), (ours, lambda f: type(acc).load_state(acc, f)),
                         (stock, acc.load_state)):
        target = Arrays(2)  # different values: the load must replace every one
        acc._custom_objects[-1] = target
        load(folder)
        _same(saved.state, target.state)


def test_a_state_load_state_would_refuse_fails_the_save_naming_file_and_key(tmp_path, closing, caplog):
    acc, setup = _accelerator(tmp_path, closing, "a")
    obj = Arrays(1)
    obj.state["meta"] = {"started": datetime.datetime(2024, 5, 1), "objects": np.array([1, "a"], dtype=object)}
    acc.register_for_checkpointing(obj)
    setup.step()
    with caplog.at_level(logging.ERROR, logger="fastckpt"):
        folder = acc.save_state(str(tmp_path / "ckpt"))  # returns at once: the check runs in the background
        with pytest.raises(UnsafeCheckpointError) as info:
            closing[-1].wait()
    message = str(info.value)
    assert "custom_checkpoint_1.pkl" in message and "allowed_classes" in message and "allow_unsafe_pickle" in message
    assert "meta/started (datetime.datetime)" in message and "meta/objects (numpy.ndarray)" in message
    assert "custom_checkpoint_1.pkl" in caplog.text  # said when the check ran, not only at the next call
    assert not os.path.exists(os.path.join(folder, "manifest.json"))  # never committed
    # nothing of the save was written; the pending marker (written inside save_state) says the folder is no checkpoint
    assert os.listdir(folder) == [".fastckpt-pending"]


def test_allowed_classes_and_the_unsafe_opt_in_let_the_same_state_save_and_load(tmp_path, closing):
    for name, enable in (("allowed", {"config": CheckpointConfig(root=str(tmp_path / "allowed" / "c"),
                                                                   allowed_classes=["fractions.Fraction"])}),
                         ("unsafe", {"allow_unsafe_pickle": True})):
        acc, setup = _accelerator(tmp_path, closing, name, **enable)
        obj = Arrays(1)
        obj.state["ratio"] = Fraction(3, 7)
        acc.register_for_checkpointing(obj)
        setup.step()
        folder = acc.save_state(str(tmp_path / name / "ckpt"))
        closing[-1].wait()
        fresh = Arrays(2)
        acc._custom_objects[-1] = fresh
        acc.load_state(folder)
        assert fresh.state.pop("ratio") == Fraction(3, 7)
        obj.state.pop("ratio")
        _same(obj.state, fresh.state)


def test_an_optimizer_state_stock_could_not_load_fails_the_save(tmp_path, closing):
    """optimizer.bin is read by Accelerate's own weights-only load, with or without fastckpt: stock saves a numpy
    scalar in a param group and then fails at load_state; fastckpt says so at the save."""
    acc, setup = _accelerator(tmp_path, closing, "a")
    setup.optimizer.param_groups[0]["note"] = np.float64(0.5)
    setup.step()
    stock = str(tmp_path / "stock")
    type(acc).save_state(acc, stock)
    with pytest.raises(Exception, match="numpy"):  # stock itself cannot resume from what it saved
        type(acc).load_state(acc, stock)
    acc.save_state(str(tmp_path / "ours"))
    with pytest.raises(UnsafeCheckpointError, match=r"optimizer\.bin.*param_groups/0/note \(numpy\.float64\)"):
        closing[-1].wait()


class Holder:
    """An allowlisted class of the core's object table, holding numpy values."""

    def __init__(self, arr: np.ndarray, scale: np.float32) -> None:
        self.arr, self.scale = arr, scale

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Holder) and self.arr.dtype == other.arr.dtype
                and self.arr.tobytes() == other.arr.tobytes() and type(self.scale) is type(other.scale)
                and self.scale.tobytes() == other.scale.tobytes())


def test_core_save_of_an_allowed_object_holding_numpy_loads_and_keeps_the_users_safe_globals(tmp_path):
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([Holder])  # the user's own registration, for their own torch.load
    try:
        cfg = CheckpointConfig(root=str(tmp_path), allowed_classes=[f"{__name__}.Holder"])
        value = Holder(np.arange(6, dtype=np.float32).reshape(2, 3), np.float32(1.5))
        with Checkpointer(cfg) as ckpt:
            ckpt.save({"w": torch.ones(2), "h": value, "ids": {np.int64(3), np.int64(4)}}, step=1).wait()
            assert Holder in torch.serialization.get_safe_globals()  # a save never takes the user's back
            loaded = ckpt.load()
        assert loaded["h"] == value
        assert loaded["ids"] == {np.int64(3), np.int64(4)}
        assert all(type(v) is np.int64 for v in loaded["ids"])
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
