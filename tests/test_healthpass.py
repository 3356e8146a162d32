"""Issue 27: the health statistics and the CRC32C of a staged shard in one blocked pass (format/healthpass.py).

The combined pass must equal the separate passes it replaces: the CRC32C bit for bit, ``n``/``nan``/``inf``/
``absmax``/``fp`` exactly, ``l2`` within the documented 1e-6 (the reference here is float64 over every finite value),
for every dtype a checkpoint holds, records staged off their alignment, NaN/Inf in one block only, squares beyond
float32, empty tensors and tensors smaller and larger than a block; and the I/O worker reads each tensor's bytes
once for both.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import fastckpt.format.healthpass as healthpass
import fastckpt.format.openlayout as openlayout
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.format.checksum import crc32c
from fastckpt.format.healthpass import GRAIN, GROUP, fingerprint, tensor_pass
from tests import passpaths
from tests.helpers import assert_bit_equal, clone_state

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
           torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_SIZES = [0, 1, 7, GROUP - 1, GROUP, GROUP + 1, GRAIN, GRAIN + 3 * GROUP + 5, 3 * GRAIN + 17]


def _random(n: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.rand(n) > 0.5
    if dtype.is_complex:
        return torch.randn(n, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(n) * 3).to(dtype)
    if dtype is torch.uint8:
        return torch.randint(0, 256, (n,), dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(1 << 40)), min(info.max, 1 << 40), (n,), dtype=dtype)


def _staged(t: torch.Tensor, misalign: int) -> torch.Tensor:
    """``t``'s bytes as a torch file stages a record: flat uint8, possibly ``misalign`` bytes off alignment."""
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    buf = torch.zeros(raw.numel() + misalign, dtype=torch.uint8)
    buf[misalign:] = raw
    return buf[misalign:]


def _reference(raw: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    """The separate passes, value by value in float64: what every statistic means."""
    data = raw.clone()
    size = torch.empty(0, dtype=dtype).element_size()
    if data.numel() % size:
        vals = data.to(torch.float64)
    else:
        t = data.view(dtype)
        t = torch.view_as_real(t).reshape(-1) if t.is_complex() else t
        vals = t.to(torch.float64)
    finite = vals[torch.isfinite(vals)]
    absmax = float(finite.abs().max()) if finite.numel() else 0.0
    l2 = float(torch.linalg.vector_norm(finite)) if finite.numel() else 0.0
    return {"n": vals.numel(), "nan": int(torch.isnan(vals).sum()), "inf": int(torch.isinf(vals).sum()),
            "absmax": absmax if math.isfinite(absmax) else None, "l2": l2 if math.isfinite(l2) else None,
            "fp": fingerprint(raw.clone().numpy(), raw.numel()), "crc": crc32c(raw.clone().numpy().tobytes())}


def _check(raw: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    got, crc = tensor_pass(raw, dtype, crc=True)
    want = _reference(raw, dtype)
    assert crc == want["crc"], (dtype, raw.numel())
    for field in ("n", "nan", "inf", "absmax", "fp"):
        assert got[field] == want[field], (field, dtype, raw.numel(), got[field], want[field])
    if want["l2"] is None or not want["l2"]:
        assert got["l2"] == want["l2"], (dtype, got["l2"], want["l2"])
    else:
        assert abs(got["l2"] - want["l2"]) / want["l2"] < 1e-6, (dtype, got["l2"], want["l2"])
    return got


@pytest.mark.parametrize("dtype", _DTYPES, ids=str)
def test_combined_pass_equals_separate_passes_for_every_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for n in _SIZES:
        t = _random(n, dtype)
        for misalign in (0, 1, 3):  # a torch file's records start where the previous one ended
            got = _check(_staged(t, misalign), dtype)
            assert got["nan"] == got["inf"] == 0
        assert tensor_pass(_staged(t, 0), dtype)[1] is None  # no CRC asked: none taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.complex64], ids=str)
def test_the_big_blocks_of_many_cpu_hosts_give_the_same_statistics(dtype: torch.dtype) -> None:
    """BLOCK is GRAIN * 32 where CPUs are many (fewer Python calls, fewer GIL hand-offs): nothing else changes."""
    torch.manual_seed(1)
    for n in (0, 7, GRAIN * 32 - 1, GRAIN * 32 + 3 * GROUP + 5, 2 * GRAIN * 32 + 17):
        t = _random(n, dtype)
        if n > 100 and dtype.is_floating_point:
            t[n // 2] = float("nan")  # flagged groups and blocks are measured again: in a big block too
            t[-3] = float("-inf")
        for misalign in (0, 3):
            raw = _staged(t, misalign)
            small, big = tensor_pass(raw, dtype, crc=True, block=GRAIN), tensor_pass(raw, dtype, crc=True,
                                                                                       block=GRAIN * 32)
            assert small[1] == big[1], (dtype, n)
            for field in ("n", "nan", "inf", "absmax", "fp"):
                assert small[0][field] == big[0][field], (field, dtype, n)
            if small[0]["l2"]:
                assert abs(small[0]["l2"] - big[0]["l2"]) / small[0]["l2"] < 1e-6
            else:
                assert small[0]["l2"] == big[0]["l2"]


@pytest.mark.parametrize("threads", [1, 2])
def test_blocks_grow_only_where_no_reduction_can_fan_out(monkeypatch, threads: int) -> None:
    """On a host of few CPUs a block holds GRAIN values while torch's intra-op pool has several threads (a larger
    reduction would fan out beside training), and GRAIN * 32 once it has one (none can: fewer calls, fewer GIL
    hand-offs); the statistics and the CRC are the same either way."""
    monkeypatch.setattr(healthpass, "BLOCK", GRAIN)  # what a host of fewer than 8 CPUs computes at import
    before = torch.get_num_threads()
    t = (torch.randn(GRAIN * 40 + 3 * GROUP + 7) * 3)
    want = tensor_pass(t.view(torch.uint8), torch.float32, crc=True, block=GRAIN)
    sizes: list[int] = []
    real = torch.amax  # float32 blocks take an amin and an amax (faster than one aminmax there)
    monkeypatch.setattr(torch, "amax", lambda v, **kw: sizes.append(v.numel()) or real(v, **kw))
    torch.set_num_threads(threads)
    try:
        got = tensor_pass(t.view(torch.uint8), torch.float32, crc=True)
    finally:
        torch.set_num_threads(before)
    assert max(sizes) == (GRAIN * 32 if threads == 1 else GRAIN)
    assert got[1] == want[1] and all(got[0][k] == want[0][k] for k in ("n", "nan", "inf", "absmax", "fp"))
    assert abs(got[0]["l2"] - want[0]["l2"]) / want[0]["l2"] < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_split_and_joint_extremes_agree(dtype: torch.dtype) -> None:
    """float32 and float64 take an amin and an amax per block, 16-bit floats one aminmax: the exact absmax either
    way, with a NaN and an Inf in a later block (each propagates through both, and is counted)."""
    torch.manual_seed(3)
    t = _random(3 * GRAIN + 5 * GROUP + 9, dtype)
    clean = tensor_pass(_staged(t, 0), dtype, block=GRAIN)[0]
    assert clean["absmax"] == float(t.abs().max())
    t[GRAIN + 7], t[-2] = float("nan"), float("-inf")
    dirty = tensor_pass(_staged(t, 0), dtype, block=GRAIN)[0]
    finite = t[torch.isfinite(t)]
    assert (dirty["nan"], dirty["inf"]) == (1, 1) and dirty["absmax"] == float(finite.abs().max())


def test_odd_byte_count_is_measured_as_bytes() -> None:
    raw = torch.arange(GRAIN + 11, dtype=torch.int64).to(torch.uint8)  # 4-byte dtype, not a multiple of 4
    got = _check(raw, torch.float32)
    assert got["n"] == raw.numel() and got["absmax"] == 255.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64])
def test_nan_and_inf_in_one_block_only_are_counted_exactly(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    t = _random(3 * GRAIN + 100, dtype)
    real = torch.view_as_real(t).reshape(-1) if t.is_complex() else t
    at = GRAIN + 5 * GROUP + 3  # in the second block only
    real[at], real[at + 1], real[at + 700] = float("nan"), float("inf"), -float("inf")
    real[-1] = float("nan")  # and one in the tail (not a whole group)
    for misalign in (0, 2):
        got = _check(_staged(t, misalign), dtype)
        assert (got["nan"], got["inf"]) == (2, 2)
    everything = torch.full((GRAIN + 9,), float("nan"), dtype=torch.float32)
    got = _check(_staged(everything, 0), torch.float32)
    assert got["nan"] == GRAIN + 9 and got["absmax"] == 0.0 and got["l2"] == 0.0


def test_squares_beyond_float32_are_measured_in_float64() -> None:
    huge = torch.full((1000,), 1e30, dtype=torch.float32)  # float32 squares overflow: float64, exactly
    got, _ = tensor_pass(_staged(huge, 0), torch.float32)
    assert got["l2"] == huge.double().norm().item() and got["absmax"] == float(torch.tensor(1e30))
    torch.manual_seed(2)
    t = torch.randn(2 * GRAIN + 5)
    t[GRAIN + 17] = 3e30  # one overflowing group in one block
    _check(_staged(t, 0), torch.float32)
    wide = torch.randn(GRAIN + 1, dtype=torch.float64)
    wide[5] = 1e200  # beyond float64 squares too: no L2, like before
    assert _check(_staged(wide, 0), torch.float64)["l2"] is None
    wide[5], wide[-1] = 1.0, -1.7e300  # in the tail, measured in float64 one value at a time: raised OverflowError
    got = _check(_staged(wide, 0), torch.float64)
    assert got["l2"] is None and got["absmax"] == 1.7e300


def test_reductions_stay_on_the_calling_thread() -> None:
    """No reduction of the pass sees more than torch's grain size, so none fans out on torch's intra-op threads
    (a process-wide setting the I/O workers must not use): every call is seen with at most GRAIN values."""
    seen: list[int] = []

    def seeing(real: Any) -> Any:
        def reduce(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen.append(x.numel())
            return real(x, *args, **kwargs)
        return reduce

    raw = _staged(torch.randn(10 * GRAIN + 3), 0)
    want = _reference(raw, torch.float32)
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.linalg, "vector_norm", seeing(torch.linalg.vector_norm))
    for name in ("aminmax", "amin", "amax"):
        mp.setattr(torch, name, seeing(getattr(torch, name)))
    try:
        got, crc = tensor_pass(raw, torch.float32, crc=True)
    finally:
        mp.undo()
    assert len(seen) >= 2 * 10 and max(seen) <= GRAIN, max(seen)  # two reductions or more per block
    assert crc == want["crc"] and got["absmax"] == want["absmax"]


def test_io_worker_reads_each_tensor_once_for_crc_and_health(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam, block by block (a thread that cannot be made serial): every CRC32C over tensor bytes comes from
    the blocked pass, none from the writer's own pass, and every tensor goes through the pass exactly once; the
    checkpoint verifies on load and restores bit for bit."""
    passpaths.use(monkeypatch, "blocked")
    passes: Counter = Counter()
    real_pass = healthpass.tensor_pass

    def counted_pass(raw: torch.Tensor, dtype: torch.dtype, crc: bool = False) -> Any:
        passes[(raw.numel(), crc, threading.current_thread().name.split("_")[0])] += 1
        return real_pass(raw, dtype, crc)

    monkeypatch.setattr(healthpass, "tensor_pass", counted_pass)
    crc_bytes = _crc_bytes(monkeypatch, healthpass)
    state, want = _seam_state()
    ck = Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 1 << 16}))
    try:
        ck.save(state, 1).wait()
        tensor_bytes = sum(t.numel() * t.element_size() for t in state.values())
        assert crc_bytes["pass"] == tensor_bytes, dict(crc_bytes)
        assert crc_bytes["writer"] < 4096 * len(state), dict(crc_bytes)  # the shard headers only
        assert sorted(n for (n, _, _) in passes) == sorted(t.numel() * t.element_size() for t in state.values())
        assert all(crc and thread.startswith(("fastckpt-io", "fastckpt-boost")) for (_, crc, thread) in passes)
        assert_bit_equal(want, ck.load(1))  # persist.verify_on_load: the files' CRCs come from the pass
    finally:
        ck.close()


def _crc_bytes(monkeypatch: pytest.MonkeyPatch, pass_module: Any) -> Counter:
    """The bytes CRC32C'd by the pass (``pass_module``'s crc32c) and by the open layout's writer, counted."""
    counted: Counter = Counter()

    def counting(real: Any, who: str) -> Any:
        def crc(data: Any, value: int = 0) -> int:
            counted[who] += len(data)
            return real(data, value)
        return crc

    monkeypatch.setattr(pass_module, "crc32c", counting(pass_module.crc32c, "pass"))
    monkeypatch.setattr(openlayout, "crc32c", counting(openlayout.crc32c, "writer"))
    return counted


def _seam_state() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(3)
    state = {"a": torch.randn(3 * GRAIN + 7), "b": torch.randn(5, 7).to(torch.bfloat16), "c": torch.arange(9),
             "e": torch.empty(0)}
    return state, clone_state(state)


def test_io_worker_batched_pass_reads_each_tensor_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same seam on the I/O workers' batched pass (format/batchpass.py, a serial thread): every tensor byte is
    checksummed once by the pass and never by the writer, each shard's tensors are measured once, on an I/O worker,
    and the checkpoint verifies on load and restores bit for bit."""
    import fastckpt.format.batchpass as batchpass
    import fastckpt.format.health as health
    from tests import passpaths

    passpaths.use(monkeypatch, "batched")  # the compiled pass's twin: tests/test_fused_pass.py
    measured: Counter = Counter()
    real_run = batchpass.run

    def counted_run(lay: Any, *args: Any, **kwargs: Any) -> Any:
        measured[threading.current_thread().name.split("_")[0]] += len(lay.entries)
        return real_run(lay, *args, **kwargs)

    monkeypatch.setattr(batchpass, "run", counted_run)
    crc_bytes = _crc_bytes(monkeypatch, health)
    state, want = _seam_state()
    ck = Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 1 << 16}))
    try:
        ck.save(state, 1).wait()
        assert crc_bytes["pass"] == sum(t.numel() * t.element_size() for t in state.values()), dict(crc_bytes)
        assert crc_bytes["writer"] < 4096 * len(state), dict(crc_bytes)  # the shard headers only
        assert sum(measured.values()) == len(state), dict(measured)
        assert all(t.startswith(("fastckpt-io", "fastckpt-boost")) for t in measured), dict(measured)
        assert_bit_equal(want, ck.load(1))
    finally:
        ck.close()


def test_torch_file_crc32_comes_from_the_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch file (Lightning's ``.ckpt``): each record's CRC-32 (the zip needs it) is taken by the health pass,
    never by the format's own second read; the file passes the zip's CRC checks and loads bit for bit."""
    import zipfile

    from fastckpt.format.torchfile import TorchFileFormat, verify_torch_file

    own: list[int] = []
    real = TorchFileFormat.checksum

    def counted(self: Any, data: Any, entries: Any) -> Any:
        own.append(len(entries))
        return real(self, data, entries)

    monkeypatch.setattr(TorchFileFormat, "checksum", counted)
    torch.manual_seed(4)
    state = {"w": torch.randn(3 * GRAIN + 7), "h": torch.randn(9, 5).to(torch.float16), "step": torch.tensor(3),
             "e": torch.empty(0)}
    want = clone_state(state)
    ck = Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 1 << 16}))
    try:
        ck.save_file(state, "a.ckpt", step=1).wait()
    finally:
        ck.close()
    assert own == [], own
    path = tmp_path / "a.ckpt"
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every record's CRC-32 is right
    assert verify_torch_file(str(path)) == []
    assert_bit_equal(want, torch.load(path, weights_only=True))


@pytest.mark.parametrize("seed", range(3))
def test_fingerprints_of_a_shard_equal_each_tensors_fingerprint(seed: int) -> None:
    """The batched form (one gather a shard: format/batchpass.py, engine/devicehealth.py) must give exactly what
    ``fingerprint`` gives span for span: records written before it are compared with records written after."""
    import random

    rng = random.Random(seed)
    data = torch.randint(0, 256, (3_000_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    mv = memoryview(data.numpy())
    spans = [(0, 0), (0, len(data)), (len(data) - 4097, 4097), (len(data) - 4096, 4096), (5, 64 * 64 + 1)]
    for _ in range(200):
        n = rng.choice([0, 1, 63, 64, 4095, 4096, 4097, 5000, 70_000, 1_000_001])
        spans.append((rng.randrange(0, len(data) - n + 1), n))
    rng.shuffle(spans)
    assert healthpass.fingerprints(mv, spans) == [fingerprint(mv[a:a + n], n) for a, n in spans]
    assert healthpass.fingerprints(mv, []) == []
    # a flipped byte at a span's start (its first window) changes that span's fingerprint; spans without it keep theirs
    before = healthpass.fingerprints(mv, spans)
    k, (a, n) = next((k, s) for k, s in enumerate(spans) if s[1] > 4096)
    data[a] ^= 0xFF
    after = healthpass.fingerprints(mv, spans)
    assert after[k] != before[k]
    assert all(after[j] == before[j] for j, (a0, n0) in enumerate(spans) if not a0 <= a < a0 + n0)
    assert after == [fingerprint(mv[a0:a0 + n0], n0) for a0, n0 in spans]
