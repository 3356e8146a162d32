"""Issue 27 (stall): the single-pass copy + CRC32C (``staging.crc_in_copy``) and write pacing
(``persist.pace_writes``).

With ``crc_in_copy`` the copy thread checksums each chunk of the staged copy right after copying it, and the
I/O workers read the staged bytes only to write them: every tensor's CRC is taken once, on the copy thread, and
the checkpoint verifies on load and restores bit for bit. Write pacing spreads shard writes at the measured
bandwidth and never holds a closing pipeline.
"""
from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import fastckpt.engine.onepass as onepass
import fastckpt.format.fused as fused
import fastckpt.format.healthpass as healthpass
import fastckpt.format.openlayout as openlayout
from fastckpt import CheckpointConfig, Checkpointer, ConfigError
import fastckpt.format.health as health
from fastckpt.engine.writepace import WritePacer
from fastckpt.format.checksum import crc32c
from tests import passpaths
from tests.helpers import assert_bit_equal, clone_state

# One tensor of 1.5 MiB (more than one onepass.CHUNK, so the CRC runs on across chunks), one odd-sized, one empty.
_SIZES = {"big": 393_216 + 7, "odd": 1001, "empty": 0}


def _model() -> nn.ParameterDict:
    torch.manual_seed(0)
    return nn.ParameterDict({k: nn.Parameter(torch.randn(n)) for k, n in _SIZES.items()})


def _step(model: nn.ParameterDict, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    sum(p.pow(2).sum() for p in model.values()).backward()
    opt.step()


def _crc_calls(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count the CRC32C passes over tensor-sized data (not the shard headers), by the calling thread's kind."""
    sizes = {4 * n for n in _SIZES.values() if n}
    calls: Counter = Counter()

    def counting(module: Any) -> Any:
        real = module.crc32c

        def crc(data: Any, value: int = 0) -> int:
            if len(data) in sizes or module in (onepass, healthpass, health):  # block by block, or parts
                calls["-".join(threading.current_thread().name.split("-")[:2]),
                      len(data) in sizes or module is healthpass] += 1
            return real(data, value)
        return crc

    monkeypatch.setattr(onepass, "crc32c", counting(onepass))
    monkeypatch.setattr(openlayout, "crc32c", counting(openlayout))
    monkeypatch.setattr(healthpass, "crc32c", counting(healthpass))
    monkeypatch.setattr(health, "crc32c", counting(health))  # the I/O workers' batched pass (format/batchpass.py)
    real_run = fused.run

    def compiled(k: Any, lay: Any, *, tensors: Any, health: bool, **kw: Any) -> Any:  # the compiled pass: every entry's CRC
        got = real_run(k, lay, tensors=tensors, health=health, **kw)
        if got is not None:
            calls["-".join(threading.current_thread().name.split("-")[:2]), True] += len(lay.entries)
        return got

    monkeypatch.setattr(fused, "run", compiled)
    return calls


def _staged_unhurried(handle: Any) -> None:
    """Wait for staging without the hurry a ``wait_staged()`` sets (it would make the copy thread stage plainly)."""
    assert handle._staged.wait(60), "staging never finished"
    assert not handle.hurry.is_set()


@pytest.mark.parametrize("path", passpaths.PATHS)
@pytest.mark.parametrize("in_copy", [True, False])
def test_crc_taken_once_on_the_copy_thread(tmp_path, monkeypatch, in_copy: bool, path: str) -> None:
    passpaths.use(monkeypatch, path)
    calls = _crc_calls(monkeypatch)
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    _step(model, opt)
    ck = Checkpointer(CheckpointConfig(root=str(tmp_path), staging={"crc_in_copy": in_copy},
                                       persist={"chunk_bytes": 1 << 20}))
    ck.watch(opt)  # lazy: the copy thread stages the parameters and moments
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    want = clone_state(state)
    _staged_unhurried(ck.save(state, 1))
    _step(model, opt)  # the seal: staging completed before this step changes anything
    ck.wait()
    io_reads = sum(n for (thread, whole), n in calls.items() if thread == "fastckpt-io" and whole)
    copy_crcs = sum(n for (thread, _), n in calls.items() if thread == "fastckpt-copy")
    if in_copy:
        assert io_reads == 0, f"the I/O workers read the staged bytes again for their CRC: {dict(calls)}"
        assert copy_crcs > 0, f"no CRC was taken on the copy thread: {dict(calls)}"
    else:  # the contrast: without it, the I/O workers take them (in the health pass, format/healthpass.py)
        assert io_reads > 0 and copy_crcs == 0, dict(calls)
    got = ck.load(1)  # persist.verify_on_load: every file's CRC (built from the tensors' CRCs) is checked
    assert_bit_equal(want, got)
    ck.close()


def test_copy_with_crcs_matches_a_separate_pass() -> None:
    torch.manual_seed(1)
    srcs: list[torch.Tensor | None] = [torch.randn(700_001), torch.randn(3), torch.empty(0)]
    from fastckpt.format.plan import TensorEntry

    entries, offset = [], 0
    for i, t in enumerate(srcs):
        nbytes = t.numel() * 4  # type: ignore[union-attr]
        entries.append(TensorEntry(index=i, dtype=torch.float32, shape=tuple(t.shape), nbytes=nbytes, lazy=True, shard=0,
                                   offset=offset))
        offset += nbytes
    buf = torch.zeros(offset, dtype=torch.uint8)
    crcs = onepass.copy_with_crcs(buf, entries, srcs)
    for e, t in zip(entries, srcs):
        staged = buf[e.offset: e.offset + e.nbytes]
        assert torch.equal(staged.view(torch.float32), t)  # type: ignore[arg-type]
        assert crcs[e.index] == crc32c(memoryview(staged.numpy()))


def _saved_health(root, in_copy: bool, monkeypatch) -> tuple[dict, set[str]]:
    """One lazy save of a state with a NaN and an Inf; its manifest's health record and the threads that measured."""
    threads = passpaths.measuring_threads(monkeypatch)
    model = _model()
    with torch.no_grad():
        model["big"][100_000], model["odd"][3] = float("nan"), float("-inf")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    want = clone_state(state)
    with Checkpointer(CheckpointConfig(root=str(root), staging={"crc_in_copy": in_copy})) as ck:
        ck.watch(opt)  # lazy: the copy thread stages the parameters
        _staged_unhurried(ck.save(state, 1))
        ck.wait()
        assert_bit_equal(want, ck.load(1))  # every file's CRC checked on load
    doc = json.loads((root / "step-000000001" / "manifest.json").read_text())
    return doc["health"], threads


@pytest.mark.parametrize("path", passpaths.PATHS)
def test_health_in_the_copy_pass_equals_the_io_workers(tmp_path, monkeypatch, path: str) -> None:
    """With ``crc_in_copy`` the copy thread's one pass also takes the health statistics (no I/O worker measures
    again), and the record is the one the I/O workers write: counts, extremes and fingerprints exact, L2 norms
    within 1e-9 (the same groups, the same sums)."""
    passpaths.use(monkeypatch, path)
    fused, fused_threads = _saved_health(tmp_path / "fused", True, monkeypatch)
    apart, apart_threads = _saved_health(tmp_path / "apart", False, monkeypatch)
    assert fused_threads == {"fastckpt-copy"}, fused_threads
    assert "fastckpt-copy" not in apart_threads, apart_threads
    assert fused["healthy"] is False and (fused["nan"], fused["inf"]) == (apart["nan"], apart["inf"]) == (1, 1)
    assert fused["tensors"].keys() == apart["tensors"].keys() and fused["complete"] and apart["complete"]
    for key, stats in apart["tensors"].items():
        got = fused["tensors"][key]
        assert {k: got[k] for k in ("n", "nan", "inf", "absmax", "fp")} == \
            {k: stats[k] for k in ("n", "nan", "inf", "absmax", "fp")}, key
        assert got["l2"] == stats["l2"] or abs(got["l2"] - stats["l2"]) <= 1e-9 * stats["l2"], key


@pytest.mark.parametrize("path", passpaths.PATHS)
def test_a_waiting_training_thread_makes_the_copy_stage_the_rest_plainly(tmp_path, monkeypatch, path: str) -> None:
    """Once the training thread blocks on staging (``wait_staged`` at its optimizer step), the copy thread stages
    the remaining shards plainly: the shard it was in keeps its one pass, the others are checksummed and measured
    by the I/O workers, and the checkpoint's health record is complete, restores bit for bit."""
    passpaths.use(monkeypatch, path)
    started, calls = threading.Event(), []
    name = "copy_with_health" if path == "blocked" else "copy_batched"
    real = getattr(onepass, name)

    def first_waits(*args):
        calls.append(threading.current_thread().name)
        started.set()
        assert handle_box[0].hurry.wait(60)  # held until the training thread is waiting for staging
        return real(*args)

    monkeypatch.setattr(onepass, name, first_waits)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.state_dict()}
    want = clone_state(state)
    handle_box: list[Any] = []
    with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 1 << 20})) as ck:
        ck.watch(opt)
        handle_box.append(ck.save(state, 1))
        assert started.wait(60)
        handle_box[0].wait_staged()  # the training thread waits: the hurry is set, the copy goes on
        _step(model, opt)
        info = handle_box[0].wait()
        assert_bit_equal(want, ck.load(1))
    assert len(calls) == 1 and calls[0].startswith("fastckpt-copy"), calls  # the first shard only
    assert info is not None and len(json.loads((tmp_path / "step-000000001" / "manifest.json").read_text())
                                    ["files"]) >= 2  # several shards: some staged plainly
    health = json.loads((tmp_path / "step-000000001" / "manifest.json").read_text())["health"]
    assert health["complete"] and health["healthy"] and set(health["tensors"]) == {f"model/{k}" for k in _SIZES}


def test_copy_with_health_copies_every_byte_and_measures_the_staged_copy() -> None:
    """Block by block (tensors over several blocks, an odd tail, an empty one): the staged bytes equal the sources,
    the CRCs equal a separate pass's, the statistics equal ``tensor_pass`` on the staged bytes."""
    from fastckpt.format.plan import TensorEntry

    torch.manual_seed(2)
    srcs: list[torch.Tensor | None] = [torch.randn(3 * healthpass.GRAIN + 700), torch.randn(5), torch.empty(0),
                                       torch.randn(1001).to(torch.bfloat16)]
    entries, offset = [], 0
    for i, t in enumerate(srcs):
        nbytes = t.numel() * t.element_size()  # type: ignore[union-attr]
        entries.append(TensorEntry(index=i, dtype=t.dtype, shape=tuple(t.shape),  # type: ignore[union-attr]
                                   nbytes=nbytes, lazy=True, shard=0, offset=offset))
        offset += nbytes
    buf = torch.zeros(offset, dtype=torch.uint8)
    crcs, stats = onepass.copy_with_health(buf, entries, list(srcs), ["a", "b", "c", "d"])
    for e, t, key in zip(entries, srcs, "abcd"):
        staged = buf[e.offset: e.offset + e.nbytes]
        assert torch.equal(staged.view(t.dtype), t)  # type: ignore[union-attr]
        assert crcs[e.index] == crc32c(memoryview(staged.numpy()))
        want = healthpass.tensor_pass(staged, e.dtype)[0]
        assert {k: v for k, v in stats[key].items() if k != "l2"} == {k: v for k, v in want.items() if k != "l2"}
        assert abs(stats[key]["l2"] - want["l2"]) <= 1e-9 * max(want["l2"], 1.0)


@pytest.mark.parametrize("section,field", [("staging", "crc_in_copy"), ("persist", "pace_writes")])
def test_flags_are_validated(tmp_path, section: str, field: str) -> None:
    with pytest.raises(ConfigError, match=f"{section}.{field} must be true or false"):
        CheckpointConfig(root=str(tmp_path), **{section: {field: "yes"}})


def test_pacer_spreads_takes_at_the_measured_rate() -> None:
    pacer = WritePacer(burst_bytes=1000)
    t0 = time.monotonic()
    pacer.take(1000)
    pacer.take(1000)  # nothing measured yet: never paced
    assert time.monotonic() - t0 < 0.05 and pacer.rate is None
    pacer.measured(1000, 0.1)  # 10 kB/s
    assert pacer.rate == pytest.approx(10_000)
    pacer.take(1000)  # the bucket refilled while idle? it started full and the takes above were free
    t1 = time.monotonic()
    pacer.take(1000)  # empty now: 1000 bytes at 10 kB/s
    assert time.monotonic() - t1 >= 0.09
    assert pacer.waited_s >= 0.09


def test_pacer_close_releases_a_waiting_worker() -> None:
    pacer = WritePacer(burst_bytes=1000)
    pacer.measured(1, 1.0)  # 1 byte per second: a full bucket would take minutes
    pacer.take(1000)
    started = threading.Event()
    done = threading.Event()

    def worker() -> None:
        started.set()
        pacer.take(1000)
        done.set()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    assert started.wait(5)
    pacer.close()
    assert done.wait(5), "close() left a worker waiting for tokens"


def test_paced_writes_restore_bit_exact(tmp_path) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters())
    _step(model, opt)
    ck = Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"pace_writes": True, "chunk_bytes": 1 << 16}))
    ck.watch(opt)
    wants = []
    for step in (1, 2):
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        wants.append(clone_state(state))
        ck.save(state, step)
        _step(model, opt)
        ck.wait()
    for step, want in zip((1, 2), wants):
        assert_bit_equal(want, ck.load(step))
    ck.close()


@pytest.mark.parametrize("path", passpaths.PATHS)
@pytest.mark.parametrize("health", [True, False])
def test_a_write_landing_during_the_single_pass_copy_is_refused(tmp_path, monkeypatch, health: bool,
                                                                path: str) -> None:
    """The mutation guard's checks around each entry hold on the single-pass path too (with the health statistics
    in it or not; batched or block by block): a write that lands right after a tensor was copied and checksummed
    fails the save, and nothing is committed."""
    from fastckpt import SnapshotMutatedError

    passpaths.use(monkeypatch, path)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def write_odd(sources) -> None:  # the "concurrent" write, deterministically placed after its copy
        if any(t.data_ptr() == model["odd"].data_ptr() for t in sources):
            with torch.no_grad():
                model["odd"].add_(1.0)  # copied and checksummed: its after-copy check must see this

    if path in ("batched", "compiled"):
        passpaths.around_fill(monkeypatch, lambda sources: None, write_odd)
    else:
        name = "copy_with_health" if health else "copy_with_crcs"
        real = getattr(onepass, name)

        def copy_then_write(buf, entries, tensors, *rest):
            def each():
                for e in entries:
                    yield e
                    write_odd([tensors[e.index]])
            return real(buf, each(), tensors, *rest)

        monkeypatch.setattr(onepass, name, copy_then_write)
    with Checkpointer(CheckpointConfig(root=str(tmp_path), staging={"crc_in_copy": True},
                                       health={"enabled": health})) as ck:
        ck.watch(opt)
        handle = ck.save({"model": model.state_dict()}, step=1)
        _staged_unhurried(handle)  # the one pass ran (a wait() right away would have it stage plainly)
        with pytest.raises(SnapshotMutatedError, match="model/odd"):
            handle.wait()
        assert ck.list() == []
