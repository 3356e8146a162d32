"""``save_last="link"``: ``last.ckpt`` moves once its target has landed, and only forward.

Each link request waits for its save's commit (fastckpt_lightning/versioning.py). A save that lands after a later
one (its commit callback running late) must not point ``last.ckpt`` back at its older file, which top-k may have
removed in between: the dangling link tests/test_lightning_fidelity.py::test_save_last_link_names_only_landed_files
caught about once in 30 runs.
"""
from __future__ import annotations

import os
import pickle
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, Callable

from fastckpt_lightning import pending
from fastckpt_lightning.versioning import LinkWhenLanded


class _Handle:
    """What the link needs of a SaveHandle: ``durable`` and ``add_done_callback``."""

    def __init__(self) -> None:
        self.durable: Future = Future()

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self.durable.add_done_callback(lambda _: fn(self))


def _trainer(barriers: list[int]) -> Any:
    return SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda: barriers.append(1)))


def _save(path: os.PathLike) -> _Handle:
    handle = _Handle()
    pending.add(os.fspath(path), handle)  # type: ignore[arg-type]
    return handle


def test_a_save_landing_after_a_later_one_does_not_move_the_link_back(tmp_path) -> None:
    barriers: list[int] = []
    link, last = LinkWhenLanded(), tmp_path / "last.ckpt"
    old, new = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "epoch=0-step=2.ckpt"
    first, second = _save(old), _save(new)
    link(_trainer(barriers), str(old), str(last))
    link(_trainer(barriers), str(new), str(last))
    assert not os.path.lexists(last) and barriers == [1, 1]  # neither landed: no link yet
    new.write_bytes(b"2")
    second.durable.set_result(None)  # the later save lands first
    assert os.readlink(last) == new.name
    first.durable.set_result(None)  # the earlier one lands late, after top-k removed it
    assert os.readlink(last) == new.name and os.path.exists(last)


def test_saves_landing_in_order_move_the_link_each_time_and_a_failed_one_leaves_it(tmp_path) -> None:
    link, last = LinkWhenLanded(), tmp_path / "last.ckpt"
    files = [tmp_path / f"epoch=0-step={n}.ckpt" for n in (1, 2, 3)]
    handles = [_save(f) for f in files]
    for f in files:
        link(_trainer([]), str(f), str(last))
    files[0].write_bytes(b"1")
    handles[0].durable.set_result(None)
    assert os.readlink(last) == files[0].name
    handles[1].durable.set_exception(OSError("disk full"))  # a failed save is never linked
    assert os.readlink(last) == files[0].name
    files[2].write_bytes(b"3")
    handles[2].durable.set_result(None)
    assert os.readlink(last) == files[2].name


def test_a_landed_target_is_linked_at_once_and_the_callable_pickles(tmp_path) -> None:
    barriers: list[int] = []
    link, last = pickle.loads(pickle.dumps(LinkWhenLanded())), tmp_path / "last.ckpt"  # ddp_spawn pickles it
    done = tmp_path / "epoch=0-step=4.ckpt"
    done.write_bytes(b"4")
    link(_trainer(barriers), str(done), str(last))
    assert os.readlink(last) == done.name and barriers == [1]
