"""``persist.background_cpus`` (fastckpt/engine/affinity.py): the background threads run off the cores training uses,
the training threads are never moved, a bad setting is a clear error before any thread starts, and a kernel that
refuses leaves every save working."""
from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.engine import affinity
from fastckpt.engine.affinity import ThreadPlacement, resolve
from fastckpt.errors import ConfigError
from fastckpt.storage.local import LocalStorage
from fastckpt.tiers.persister import Persister

CPUS = affinity.usable()
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="this process may use one CPU: nothing to keep apart")


def _ours(before: set[int]) -> dict[str, set[int]]:
    """The affinity of each fastckpt thread started since ``before`` (the idents alive then): another test's
    Checkpointer, still closing, is not this one's."""
    return {t.name: set(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()
            if t.name.startswith("fastckpt-") and t.ident not in before and t.native_id is not None and t.is_alive()}


def _alive() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


@pytest.mark.parametrize("cpus,limit,want", [
    ([0, 1], 1, {1}),  # the benchmark host: training keeps CPU 0
    ([0, 1, 2, 3, 4, 5, 6, 7], 3, {5, 6, 7}),  # the last cores the gate leaves over
    ([0, 1, 2, 3], 8, {1, 2, 3}),  # never all of them: the first stays for training
    ([0, 1, 2, 3], 0, {3}),  # at least one
    ([4, 9], 1, {9}),  # a container's CPU set, not 0..n
])
def test_auto_takes_the_last_cores_training_leaves_over(cpus, limit, want) -> None:
    assert resolve("auto", limit, cpus) == frozenset(want)


def test_nothing_is_pinned_on_one_cpu_with_all_or_where_the_os_cannot_say() -> None:
    assert resolve("auto", 1, [3]) is None
    assert resolve("all", 1, [0, 1, 2]) is None
    assert resolve("auto", 1, []) is None and resolve([0], 1, []) is None


def test_auto_leaves_several_ranks_of_one_node_to_the_scheduler(monkeypatch) -> None:
    """torchrun's ranks on one node would all pick the same last cores: auto pins none of them, a list still does."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve("auto", 3, [0, 1, 2, 3, 4, 5, 6, 7]) is None
    assert resolve([6], 3, [0, 1, 2, 3, 4, 5, 6, 7]) == frozenset({6})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert resolve("auto", 3, [0, 1, 2, 3, 4, 5, 6, 7]) == frozenset({5, 6, 7})


def test_a_list_is_taken_as_is_and_a_cpu_the_process_may_not_use_names_the_field() -> None:
    assert resolve([0, 2], 1, [0, 1, 2, 3]) == frozenset({0, 2})
    with pytest.raises(ConfigError, match=r"persist.background_cpus lists CPUs \[7\].*may use \[0, 1\]"):
        resolve([1, 7], 1, [0, 1])


@pytest.mark.parametrize("bad", [[], "none", "ALL", [1.5], [True], [-1], 3, None, {"cpu": 1}])
def test_a_bad_setting_is_refused_when_the_config_is_built(bad) -> None:
    with pytest.raises(ConfigError, match="persist.background_cpus must be auto, all or a non-empty list"):
        CheckpointConfig(root="/tmp/unused", persist={"background_cpus": bad})


def test_a_list_is_kept_sorted_without_duplicates() -> None:
    cfg = CheckpointConfig(root="/tmp/unused", persist={"background_cpus": [3, 1, 3]})
    assert cfg.persist.background_cpus == [1, 3]


def test_placement_moves_enlisted_threads_and_places_later_ones_on_arrival() -> None:
    calls: list[tuple[int, frozenset[int]]] = []
    p = ThreadPlacement(apply=lambda tid, cpus: calls.append((tid, cpus)))
    p.enlist()  # no set yet: left where it is
    assert calls == []
    me = threading.get_native_id()
    p.place(frozenset({1}))
    assert calls == [(me, frozenset({1}))]
    p.place(frozenset({1}))  # unchanged: nothing to do
    assert len(calls) == 1
    started = threading.Event()
    done = threading.Event()

    def worker() -> None:
        p.enlist()
        started.set()
        done.wait()

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    assert calls[-1] == (t.native_id, frozenset({1}))
    done.set()
    t.join()
    calls.clear()
    p.place(None)  # back everywhere: only the live thread is moved, the ended one was dropped
    assert calls == [(me, frozenset(CPUS))]


def test_auto_keeps_off_the_cpu_the_training_thread_runs_on_now() -> None:
    assert resolve("auto", 1, [0, 1], avoid=1) == frozenset({0})
    assert resolve("auto", 1, [0, 1], avoid=0) == frozenset({1})
    assert resolve("auto", 1, [0, 1], avoid=None) == frozenset({1})  # the OS cannot say: the last one
    assert resolve("auto", 1, [0, 1], avoid=5) == frozenset({1})  # not one of ours (the mask changed): as unknown
    assert resolve("auto", 3, [0, 1, 2, 3, 4, 5, 6, 7], avoid=6) == frozenset({4, 5, 7})
    assert resolve("auto", 8, [0, 1, 2, 3], avoid=3) == frozenset({0, 1, 2})  # still all but one
    assert resolve([1], 1, [0, 1], avoid=1) == frozenset({1})  # a list is obeyed as it is
    assert resolve("all", 1, [0, 1], avoid=1) is None


def test_refresh_follows_the_calling_threads_cpu_under_auto_only(monkeypatch) -> None:
    monkeypatch.setattr(affinity, "usable", lambda: [0, 1])
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    now = [1]
    asked: list[int] = []

    def where() -> int:
        asked.append(now[0])
        return now[0]

    p = ThreadPlacement(apply=lambda tid, cpus: None, where=where)
    p.follow("auto", lambda: 1)
    assert p.cpus == frozenset({0})
    now[0] = 0
    p.refresh()
    assert p.cpus == frozenset({1})
    asked.clear()
    p.follow([1], lambda: 1)
    assert p.cpus == frozenset({1}) and asked == []  # a list: where training runs is not even asked


def test_current_cpu_is_one_this_thread_may_run_on() -> None:
    cpu = affinity.current_cpu()
    if cpu is None:
        pytest.skip("this OS cannot say which CPU a thread runs on (no sched_getcpu)")
    assert cpu in set(os.sched_getaffinity(0))


@needs_two
def test_a_checkpointers_threads_run_off_the_training_threads_cpu_and_training_is_never_moved(
        tmp_path, monkeypatch) -> None:
    """Where the training thread runs is asked on the training thread, inside each ``save()``; the scheduler moving it
    onto the background's CPU moves the background at the next save. (The CPU is faked: pinning the test's thread
    would change the mask ``auto`` reads.)"""
    now = [CPUS[0]]
    askers: set[int] = set()

    def where() -> int:
        askers.add(threading.get_ident())
        return now[0]

    monkeypatch.setattr(affinity, "current_cpu", where)
    before = set(os.sched_getaffinity(0))
    state = {"w": torch.randn(1 << 16), "b": torch.randn(7)}
    alive = _alive()
    with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"cpu_threads": 1})) as ck:
        ck.save(state, 1).wait()
        ours = _ours(alive)
        assert ours and all(cpus == {CPUS[-1]} for cpus in ours.values()), ours
        now[0] = CPUS[-1]
        state["w"].add_(1)
        ck.save(state, 2).wait()
        ours = _ours(alive)
        assert ours and all(cpus == {CPUS[-2]} for cpus in ours.values()), ours
        assert set(os.sched_getaffinity(0)) == before  # the training thread's own mask, untouched
        assert askers == {threading.get_ident()}
        got = ck.load()
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])


@needs_two
def test_a_lazy_save_leaves_moving_the_threads_to_the_copy_thread(tmp_path, monkeypatch) -> None:
    """Inside a lazy ``save()`` the training thread only asks where it runs; the copy thread resolves the set and
    moves the threads (system calls: ~0.1 ms of save() each time the scheduler had moved training), before it
    copies: once the snapshot is staged every background thread is off the CPU save() ran on."""
    now = [CPUS[0]]
    monkeypatch.setattr(affinity, "current_cpu", lambda: now[0])
    real = affinity._set_affinity
    applied: list[int] = []  # the threads that moved a thread

    def recorded(tid: int, cpus: frozenset[int]) -> None:
        applied.append(threading.get_ident())
        real(tid, cpus)

    monkeypatch.setattr(affinity, "_set_affinity", recorded)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alive = _alive()
    with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"cpu_threads": 1})) as ck:
        ck.watch(opt)
        ck.save(model.state_dict(), 1).wait()
        ours = _ours(alive)
        assert ours and all(cpus == {CPUS[-1]} for cpus in ours.values()), ours
        model(torch.ones(2, 64)).sum().backward()
        opt.step()
        now[0] = CPUS[-1]  # the scheduler moved training onto the background's CPU
        applied.clear()
        state = model.state_dict()
        ref = {k: v.clone() for k, v in state.items()}
        handle = ck.save(state, 2)
        assert threading.get_ident() not in applied  # save() itself moved no thread
        handle.wait_staged()
        ours = _ours(alive)
        assert ours and all(cpus == {CPUS[-2]} for cpus in ours.values()), ours
        assert applied and threading.get_ident() not in applied
        handle.wait()
        got = ck.load(2)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


@needs_two
@pytest.mark.parametrize("setting", ["all", "list"])
def test_all_leaves_the_threads_free_and_a_list_is_obeyed(tmp_path, setting) -> None:
    value = "all" if setting == "all" else [CPUS[0]]
    want = set(CPUS) if setting == "all" else {CPUS[0]}
    alive = _alive()
    with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"background_cpus": value})) as ck:
        ck.save({"w": torch.randn(1 << 12)}, 1).wait()
        ours = _ours(alive)
        assert ours and all(cpus == want for cpus in ours.values()), ours


def test_a_cpu_the_process_may_not_use_fails_the_checkpointer_before_a_thread_starts(tmp_path) -> None:
    alive = _alive()
    bad = max(CPUS or [0]) + 1
    with pytest.raises(ConfigError, match="persist.background_cpus lists CPUs"):
        Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"background_cpus": [bad]}))
    assert _ours(alive) == {}


def test_a_kernel_that_refuses_leaves_the_saves_working_and_says_so_once(tmp_path, monkeypatch, caplog) -> None:
    def refuse(tid, cpus):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(affinity.os, "sched_setaffinity", refuse)
    monkeypatch.setattr(affinity, "_refused", False)
    monkeypatch.setattr(affinity, "usable", lambda: [0, 1])
    state = {"w": torch.randn(1 << 12)}
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ck:
            for step in (1, 2):
                ck.save(state, step).wait()
            got = ck.load()
    assert torch.equal(got["w"], state["w"])
    said = [r for r in caplog.records if "could not set their affinity" in r.getMessage()]
    assert len(said) == 1


@needs_two
def test_a_persister_process_is_told_the_cpus_resolved_here(tmp_path) -> None:
    cfg = CheckpointConfig(root=str(tmp_path), staging={"shm": True}, persist={"cpu_threads": 1})
    assert Persister(LocalStorage(str(tmp_path)), cfg).opts["background_cpus"] == [CPUS[-1]]
    cfg = CheckpointConfig(root=str(tmp_path), staging={"shm": True}, persist={"background_cpus": "all"})
    assert Persister(LocalStorage(str(tmp_path)), cfg).opts["background_cpus"] == "all"


@needs_two
def test_a_training_thread_pinned_to_one_cpu_before_the_checkpointer_is_told_once(tmp_path, caplog) -> None:
    """The background threads start from their maker's mask: a training thread pinned to one CPU before it builds the
    Checkpointer gives them that CPU, and they then run in turns with training. Said once per process, naming the
    CPUs the machine offers; the saves still work; pinned after building it, nothing is said and the threads stay
    off the training thread's CPU."""
    from fastckpt.engine.once import WARNED

    cpus = sorted(os.sched_getaffinity(0))
    state = {"w": torch.randn(1 << 12)}
    WARNED.reset()
    os.sched_setaffinity(0, {cpus[0]})  # this thread only
    try:
        with caplog.at_level(logging.WARNING, logger="fastckpt"):
            with Checkpointer(CheckpointConfig(root=str(tmp_path / "pinned"))) as ck:
                for step in (1, 2):
                    ck.save(state, step).wait()
                assert torch.equal(ck.load()["w"], state["w"])
                mine = {t.name: os.sched_getaffinity(t.native_id) for t in threading.enumerate()
                        if t.name.startswith("fastckpt-")}
    finally:
        os.sched_setaffinity(0, set(cpus))
    said = [r.getMessage() for r in caplog.records if "may run on CPU" in r.getMessage()]
    assert len(said) == 1 and f"CPU {cpus[0]} alone" in said[0], said
    assert mine and all(m == {cpus[0]} for m in mine.values()), mine
    caplog.clear()
    WARNED.reset()
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        with Checkpointer(CheckpointConfig(root=str(tmp_path / "free"))) as ck:
            os.sched_setaffinity(0, {cpus[0]})  # pinned after: as the docs say
            try:
                ck.save(state, 1).wait()
                theirs = {t.name: os.sched_getaffinity(t.native_id) for t in threading.enumerate()
                          if t.name.startswith("fastckpt-")}
            finally:
                os.sched_setaffinity(0, set(cpus))
    assert not [r for r in caplog.records if "may run on CPU" in r.getMessage()]
    assert theirs and all(cpus[0] not in m for m in theirs.values()), theirs
