"""The warnings of the core mean something (issue 23, items 9 and 10).

Item 9: "persistence is falling behind" only when it is (a save waits for a staging slot, or a checkpoint stays not
durable past ``persist.max_lag_s``), once per process, on rank 0, naming the measured lag; a save that merely finds
the previous one pending (``save_last`` right after another save) is quiet.
Item 10: a lazy-mode ``save()`` with nothing lazy copies the whole state inside ``save()``: one warning, with the fix.
"""
from __future__ import annotations

import logging
import re
import threading
from typing import Iterator

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.engine.once import WARNED
from fastckpt.storage.protocol import open_storage
from tests.helpers import GatedStorage

pytestmark = pytest.mark.timeout(120)

BEHIND = "falling behind"
ALL_EAGER = "inside save(), because none of them is lazy"


@pytest.fixture(autouse=True)
def fresh_warnings() -> Iterator[None]:
    WARNED.reset()
    yield
    WARNED.reset()


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _config(root, **persist) -> CheckpointConfig:
    return CheckpointConfig.from_dict({"root": str(root), "staging": {"slots": 2}, "persist": {"workers": 1, **persist}})


def _watched(width: int = 32) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(width, width)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_save_right_after_another_is_not_falling_behind(tmp_path, caplog) -> None:
    """save_last=True's pattern: a second save at once, the first one's write still held back. Quiet."""
    storage = GatedStorage(open_storage(str(tmp_path)))
    model, opt = _watched()
    with Checkpointer(_config(tmp_path), storage=storage) as ckpt, caplog.at_level(logging.WARNING, "fastckpt"):
        ckpt.watch(opt)
        first = ckpt.save({"model": model.state_dict()}, step=1)
        assert storage.entered.wait(30)  # step 1's write is held: it is pending when step 2 saves
        second = ckpt.save({"model": model.state_dict()}, step=2, name="last")
        storage.gate.set()
        first.wait(), second.wait()
        assert torch.equal(ckpt.load(name="last")["model"]["weight"], model.weight)
    assert not _said(caplog, BEHIND), caplog.text


def test_a_checkpoint_lagging_past_the_bound_warns_once_per_process_naming_the_lag(tmp_path, caplog) -> None:
    storage = GatedStorage(open_storage(str(tmp_path / "a")))
    model, opt = _watched()
    with caplog.at_level(logging.WARNING, "fastckpt"):
        with Checkpointer(_config(tmp_path / "a", max_lag_s=0), storage=storage) as ckpt:
            ckpt.watch(opt)
            ckpt.save({"model": model.state_dict()}, step=1)
            assert storage.entered.wait(30)
            ckpt.save({"model": model.state_dict()}, step=2)
            said = _said(caplog, BEHIND)
            assert len(said) == 1, said
            assert re.search(r"checkpoint 'step-000000001' was still not durable \d+\.\d s after its save\(\) when "
                             r"'step-000000002' was saved; persist\.max_lag_s is 0 s", said[0]), said[0]
            storage.gate.set()
            ckpt.wait()
        # Another Checkpointer of the same process (Lightning builds one per folder) falls behind too: no repeat.
        storage_b = GatedStorage(open_storage(str(tmp_path / "b")))
        with Checkpointer(_config(tmp_path / "b", max_lag_s=0), storage=storage_b) as ckpt:
            ckpt.watch(opt)
            ckpt.save({"model": model.state_dict()}, step=1)
            assert storage_b.entered.wait(30)
            ckpt.save({"model": model.state_dict()}, step=2)
            storage_b.gate.set()
            ckpt.wait()
            assert torch.equal(ckpt.load(2)["model"]["weight"], model.weight)
    assert len(_said(caplog, BEHIND)) == 1


def test_a_save_waiting_for_a_slot_warns_before_it_waits_naming_the_lag(tmp_path) -> None:
    """slots=1 and the default bound (60 s): the second save stalls training, and says why before it blocks."""
    storage = GatedStorage(open_storage(str(tmp_path)))
    cfg = CheckpointConfig.from_dict({"root": str(tmp_path), "staging": {"slots": 1}, "persist": {"workers": 1}})
    said: list[str] = []
    warned = threading.Event()

    class OnWarning(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if BEHIND in record.getMessage():
                said.append(record.getMessage())
                warned.set()

    handler = OnWarning(logging.WARNING)
    logging.getLogger("fastckpt").addHandler(handler)
    a, b = {"w": torch.randn(64, 64)}, {"w": torch.randn(64, 64)}
    try:
        with Checkpointer(cfg, storage=storage) as ckpt:
            ckpt.save(a, step=1, lazy=["w"])
            assert storage.entered.wait(30)
            saver = threading.Thread(target=lambda: ckpt.save(b, step=2, lazy=["w"]).wait(), name="test-saver")
            saver.start()
            assert warned.wait(30)  # said while step 2 waits: the gate is still closed
            storage.gate.set()
            saver.join(60)
            assert not saver.is_alive()
            assert torch.equal(ckpt.load(1)["w"], a["w"]) and torch.equal(ckpt.load(2)["w"], b["w"])
    finally:
        logging.getLogger("fastckpt").removeHandler(handler)
    assert len(said) == 1, said
    assert re.search(r"save 'step-000000002' waits for a staging slot: all 1 are busy; the oldest pending checkpoint, "
                     r"'step-000000001', was saved \d+\.\d s ago", said[0]), said[0]


def test_other_ranks_never_warn(tmp_path, caplog, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")  # what torchrun sets; no process group here
    storage = GatedStorage(open_storage(str(tmp_path)))
    with Checkpointer(_config(tmp_path, max_lag_s=0), storage=storage) as ckpt, caplog.at_level(
            logging.WARNING, "fastckpt"):
        ckpt.save({"w": torch.ones(8)}, step=1)
        assert storage.entered.wait(30)
        ckpt.save({"w": torch.zeros(8)}, step=2)
        storage.gate.set()
        ckpt.wait()
    assert not _said(caplog, BEHIND) and not _said(caplog, ALL_EAGER), caplog.text


def test_save_with_nothing_lazy_warns_once_with_the_fix(tmp_path, caplog) -> None:
    state = {"w": torch.randn(256, 256), "b": torch.randn(256)}
    with Checkpointer(_config(tmp_path), storage=None) as ckpt, caplog.at_level(logging.WARNING, "fastckpt"):
        ckpt.save(state, step=1).wait()
        ckpt.save(state, step=2).wait()
        assert torch.equal(ckpt.load(2)["w"], state["w"])
    said = _said(caplog, ALL_EAGER)
    assert len(said) == 1, caplog.text
    assert "save('step-000000001') copies all 2 tensors (0.3 MB)" in said[0]
    assert "checkpointer.watch(optimizer)" in said[0] and "lazy=" in said[0] and "staging.mode: eager" in said[0]


@pytest.mark.parametrize("how", ["watch", "lazy=", "eager mode", "eager='*'", "watch, eager='*'"])
def test_no_all_eager_warning_when_something_is_lazy_or_eager_is_chosen(tmp_path, caplog, how) -> None:
    """``eager='*'``: every tensor copied inside save() by choice (the preemption's final save, a watched optimizer
    beside it): the hint about saves with nothing lazy, and its wrong reason, are not said (issue 55, item 4)."""
    model, opt = _watched()
    mode = "eager" if how == "eager mode" else "lazy"
    cfg = CheckpointConfig.from_dict({"root": str(tmp_path), "staging": {"mode": mode}})
    with Checkpointer(cfg) as ckpt, caplog.at_level(logging.WARNING, "fastckpt"):
        if how.startswith("watch"):
            ckpt.watch(opt)
        ckpt.save({"model": model.state_dict()}, step=1, lazy=["model/*"] if how == "lazy=" else (),
                  eager="*" if "eager='*'" in how else ()).wait()
        assert torch.equal(ckpt.load(1)["model"]["weight"], model.weight)
    assert not _said(caplog, ALL_EAGER), caplog.text
