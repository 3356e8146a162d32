"""Issue 53: the compiled pass (format/fused.py, format/fusedkernels.py), one GIL-free call a shard.

It must give what the other passes give, tensor for tensor (the staged bytes, the CRC32C bit for bit, ``n``, ``nan``,
``inf``, ``absmax`` and ``fp`` exactly, ``l2`` within 1e-6 of float64), including tensors holding NaN, Inf, -0.0 or
squares beyond float64; decline what it does not cover (the batched pass takes it); never read a source through a
dangling address; and its warm-up must fail loudly where it should, quietly where it should, and leave the batched
pass in place either way.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import random
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fastckpt.format.fused as fused
from fastckpt import CheckpointConfig, Checkpointer, ConfigError
from fastckpt.format.batchpass import Layout
from fastckpt.format.checksum import crc32
from fastckpt.format.plan import TensorEntry
from tests.helpers import assert_bit_equal, clone_state
from tests.test_batchpass import assert_reference, laid_out
from tests.test_healthpass import _random

_KINDS = [torch.float32] * 5 + [torch.float64, torch.bfloat16, torch.bfloat16]
_OTHERS = [torch.float16, torch.int64, torch.int8, torch.bool, torch.complex64]
_SIZES = [0, 1, 7, 511, 4096, 65_537, 70_001, 300_001]


@pytest.fixture(scope="module")
def kernel() -> fused.Kernel:
    k = fused.warm("on").result(timeout=600)
    assert k is not None, fused.state()  # numba is a dependency: a failed warm-up is a failure here
    return k


def _value(t: torch.Tensor, rng: random.Random) -> None:
    """Plant one special value: NaN, Inf, -0.0, a square beyond float64 (float64 only), or nothing."""
    if not t.numel() or not t.dtype.is_floating_point:
        return
    kind = rng.choice(["ok"] * 5 + ["nan", "inf", "negzero", "huge", "negative"])
    at = rng.randrange(t.numel())
    if kind == "nan":
        t[at] = float("nan")
    elif kind == "inf":
        t[at] = float("-inf")
    elif kind == "negzero":
        t.zero_()
        t[at] = -0.0
    elif kind == "huge" and t.dtype == torch.float64:
        t[at] = 1e200  # its square overflows float64: measured value for value
    elif kind == "negative":
        t.copy_(-t.abs() - 1)  # the largest magnitude is a minimum


def _shard(rng: random.Random, others: bool = True) -> tuple[list[torch.Tensor], list[TensorEntry], torch.Tensor]:
    """Sources laid out as format/plan.py lays a shard (widest dtype first, back to back) and a zeroed buffer."""
    dtypes = rng.choices(_KINDS, k=rng.randint(1, 10)) + (rng.choices(_OTHERS, k=rng.randint(0, 3)) if others else [])
    srcs = []
    for dtype in dtypes:
        n = rng.choice(_SIZES)
        if dtype in _OTHERS:
            n = min(n, fused.SMALL // max(torch.empty(0, dtype=dtype).element_size(), 1))
        t = _random(n, dtype)
        _value(t, rng)
        srcs.append(t.reshape(-1) if rng.random() < 0.8 or t.numel() % 7 else t.reshape(7, -1))
    return laid_out(srcs)


def test_both_checksums_are_found(kernel) -> None:
    assert set(kernel.sums) == {"crc32c", "crc32"}  # zlib-ng is a dependency: a torch file's records too


@pytest.mark.parametrize("seed", range(12))
def test_the_compiled_pass_equals_the_reference(kernel, seed: int) -> None:
    srcs, entries, buf = _shard(random.Random(seed))
    lay = Layout.of(buf, entries, [e.dtype for e in entries])
    got = fused.run(kernel, lay, tensors=srcs, health=True)
    assert got is not None, [(e.dtype, e.nbytes) for e in entries]
    assert_reference(lay, buf, srcs, *got)
    # the I/O workers' form: no copy, the staged bytes measured (a CUDA shard landed by DMA)
    crcs, stats = fused.run(kernel, lay, tensors=None, health=True)  # type: ignore[misc]
    assert_reference(lay, buf, srcs, crcs, stats)
    # health off: the CRCs alone
    buf.zero_()
    crcs2, none = fused.run(kernel, lay, tensors=srcs, health=False)  # type: ignore[misc]
    assert crcs2 == crcs and none == {}
    # a torch file's records: zip's CRC-32
    zips, _ = fused.run(kernel, lay, tensors=None, health=False, checksum="crc32")  # type: ignore[misc]
    assert zips == [crc32(bytes(buf[e.offset:e.offset + e.nbytes].numpy())) for e in lay.entries]
    assert fused.run(kernel, lay, tensors=None, health=False, checksum="adler") is None


def test_bfloat16_and_float64_extremes_are_exact(kernel) -> None:
    """The largest magnitude is taken from bits: it must be the exact value, at every width, at a chunk's edge."""
    big = torch.randn(fused.CHUNK // 2 + 3).bfloat16()
    big[fused.CHUNK // 2 + 1] = -3.0e38  # past the first chunk, negative, near bfloat16's largest
    f64 = torch.randn(fused.CHUNK // 8 * 2 + 1, dtype=torch.float64)
    f64[-1] = -1.7e300
    srcs = [f64, big]
    entries = [TensorEntry(0, torch.float64, tuple(f64.shape), f64.numel() * 8, True, 0, 0),
               TensorEntry(1, torch.bfloat16, tuple(big.shape), big.numel() * 2, True, 0, f64.numel() * 8)]
    buf = torch.zeros(f64.numel() * 8 + big.numel() * 2, dtype=torch.uint8)
    lay = Layout.of(buf, entries, [torch.float64, torch.bfloat16])
    crcs, stats = fused.run(kernel, lay, tensors=srcs, health=True)  # type: ignore[misc]
    assert stats[0]["absmax"] == 1.7e300 and stats[1]["absmax"] == float(big[fused.CHUNK // 2 + 1].abs())
    assert_reference(lay, buf, srcs, crcs, stats)


def test_what_the_kernel_does_not_cover_goes_to_the_batched_pass(kernel) -> None:
    big_int = torch.arange(fused.SMALL, dtype=torch.int64)  # 8x SMALL bytes of another dtype: batched
    entries = [TensorEntry(0, torch.int64, tuple(big_int.shape), big_int.numel() * 8, True, 0, 0)]
    lay = Layout.of(torch.zeros(big_int.numel() * 8, dtype=torch.uint8), entries, [torch.int64])
    assert fused.run(kernel, lay, tensors=[big_int], health=True) is None
    src = torch.randn(64, 32)
    entries = [TensorEntry(0, torch.float32, (32, 64), src.numel() * 4, True, 0, 0)]
    lay = Layout.of(torch.zeros(src.numel() * 4, dtype=torch.uint8), entries, [torch.float32])
    assert fused.run(kernel, lay, tensors=[src.t()], health=True) is None  # strided: torch resolves it
    assert fused.run(kernel, lay, tensors=[src.double().t()], health=True) is None  # not the staged dtype
    assert fused.run(kernel, lay, tensors=[None], health=True) is None  # gone: the batched pass names it
    assert fused.run(kernel, lay, tensors=[src.t().contiguous()], health=True) is not None
    short = Layout.of(torch.zeros(src.numel() * 4, dtype=torch.uint8), entries, [torch.float32])
    short.buf = torch.zeros(src.numel() * 4 - 4, dtype=torch.uint8)  # a layout whose buffer is too short
    assert fused.run(kernel, short, tensors=[src.t().contiguous()], health=True) is None  # never written past the end


def test_a_source_whose_data_is_swapped_is_read_from_the_storage_kept(kernel, monkeypatch) -> None:
    """The kernel reads raw addresses without the GIL: the storages behind them are held through the call, so a
    ``.data`` swapped between the lookup and the copy (the old storage's last owner letting go) reads the old,
    still allocated bytes, never freed memory (4 MiB: malloc gives it back to the system when freed, and a read
    of it would kill this process)."""
    p = torch.nn.Parameter(torch.randn(1 << 20))
    old = p.detach().clone()
    entries = [TensorEntry(0, torch.float32, tuple(p.shape), p.numel() * 4, True, 0, 0)]
    buf = torch.zeros(p.numel() * 4, dtype=torch.uint8)
    lay = Layout.of(buf, entries, [torch.float32])
    real = fused._sources
    swapped: list[bool] = []

    def swap_after_lookup(lay_: Any, tensors: Any, plain: Any) -> Any:
        got = real(lay_, tensors, plain)
        p.data = torch.zeros(1 << 20)  # the parameter was the old storage's only owner
        gc.collect()
        swapped.append(p.data_ptr() != int(got[0][0]))
        return got

    monkeypatch.setattr(fused, "_sources", swap_after_lookup)
    crcs, stats = fused.run(kernel, lay, tensors=[p], health=True)  # type: ignore[misc]
    assert swapped == [True]
    assert torch.equal(buf.view(torch.float32), old) and stats[0]["absmax"] == float(old.abs().max())


def test_the_checkpointer_takes_it_restores_bit_exact_and_records_the_same_health(tmp_path, kernel,
                                                                                  monkeypatch) -> None:
    calls: list[bool] = []
    real = fused.run

    def spy(*args: Any, **kwargs: Any) -> Any:
        got = real(*args, **kwargs)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(fused, "run", spy)
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.LayerNorm(200),
                                torch.nn.Linear(200, 50).to(torch.bfloat16), torch.nn.Linear(50, 7).double())
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    want = clone_state(state)
    records = {}
    for mode in ("on", "off"):
        monkeypatch.setattr(fused, "kernel", (lambda m, n: kernel) if mode == "on" else (lambda m, n: None))
        with Checkpointer(CheckpointConfig(root=str(tmp_path / mode), staging={"compiled_pass": mode},
                                           persist={"chunk_bytes": 1 << 18})) as ck:
            ck.watch(opt)
            handle = ck.save(state, 1)
            assert handle._staged.wait(60) and not handle.hurry.is_set()  # the one pass, unhurried
            handle.wait()
            assert_bit_equal(want, ck.load(1))
        records[mode] = json.loads((tmp_path / mode / "step-000000001" / "manifest.json").read_text())["health"]
        if mode == "on":
            assert calls and all(calls), calls  # every lazy shard in one compiled call
    on, off = records["on"]["tensors"], records["off"]["tensors"]
    assert on.keys() == off.keys() and records["on"]["healthy"] and records["on"]["complete"]
    for key in on:
        for field in ("n", "nan", "inf", "absmax", "fp"):
            assert on[key][field] == off[key][field], (key, field)
        assert abs(on[key]["l2"] - off[key]["l2"]) <= 1e-6 * max(off[key]["l2"], 1e-30), key


def test_auto_starts_the_warm_up_only_for_a_large_state(monkeypatch) -> None:
    loader = fused._Loader()
    started: list[bool] = []
    monkeypatch.setattr(fused, "_LOADER", loader)
    monkeypatch.setattr(loader, "warm", lambda loud: started.append(loud))
    assert fused.kernel("auto", fused.MIN_BYTES - 1) is None and started == []
    assert fused.kernel("off", 1 << 40) is None and started == []
    assert fused.kernel("auto", fused.MIN_BYTES) is None and started == [False]
    assert fused.kernel("on", 1) is None and started == [False, True]
    assert fused.warm("off").result() is None


def _failed_warm_up(monkeypatch, loud: bool) -> tuple[fused._Loader, list[warnings.WarningMessage]]:
    loader = fused._Loader()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader._run(loud)
    assert loader.state == "failed" and loader.done.result() is None and loader.get(True, loud) is None
    return loader, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_without_numba_auto_is_quiet_and_on_says_so(monkeypatch) -> None:
    real = fused.importlib.util.find_spec
    monkeypatch.setattr(fused.importlib.util, "find_spec", lambda name: None if name == "numba" else real(name))
    loader, said = _failed_warm_up(monkeypatch, loud=False)
    assert said == [] and "numba is not installed" in loader.reason
    loader, said = _failed_warm_up(monkeypatch, loud=True)
    assert len(said) == 1 and "pip install numba" in str(said[0].message)


def test_a_failed_compile_is_said_once_and_names_the_exit(monkeypatch) -> None:
    monkeypatch.setattr(fused, "_CHILD", "import sys; print('broken toolchain', file=sys.stderr); sys.exit(3)")
    loader, said = _failed_warm_up(monkeypatch, loud=False)
    assert "exit code 3" in loader.reason and "broken toolchain" in loader.reason
    assert len(said) == 1 and "staging.compiled_pass: off" in str(said[0].message)


def test_a_kernel_that_computes_something_else_is_never_trusted(monkeypatch) -> None:
    """The self-test runs before the kernel is used: here the checksum function is zlib's adler32 (the same C
    signature, other values)."""
    zlib = ctypes.CDLL(ctypes.util.find_library("z") or "libz.so.1")
    adler = int(ctypes.cast(zlib.adler32, ctypes.c_void_p).value)
    monkeypatch.setattr(fused, "_checksums", lambda: {"crc32c": (adler, 0xFFFFFFFF)})
    loader, said = _failed_warm_up(monkeypatch, loud=False)
    assert "self-test failed" in loader.reason and len(said) == 1


def test_a_fork_forgets_a_warm_up_in_flight_but_keeps_a_ready_kernel(kernel) -> None:
    loader = fused._Loader()
    loader.state = "warming"
    loader.after_fork()
    assert loader.state == "cold" and not loader.done.done()
    loader.state, loader.kernel = "ready", kernel
    loader.after_fork()
    assert loader.get(False, False) is kernel


def test_prewarm_waits_for_the_compiled_pass(tmp_path, kernel) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ck:
        assert ck.prewarm({"w": torch.randn(1000)}).result(timeout=600) >= 0
        assert fused.state() == ("ready", "")


@pytest.mark.parametrize("value", ["sometimes", 1, None])
def test_the_option_is_validated(tmp_path, value: Any) -> None:
    with pytest.raises(ConfigError, match="staging.compiled_pass"):
        CheckpointConfig(root=str(tmp_path), staging={"compiled_pass": value})


def test_yaml_on_and_off_mean_the_choices(tmp_path) -> None:
    assert CheckpointConfig(root=str(tmp_path), staging={"compiled_pass": False}).staging.compiled_pass == "off"
    assert CheckpointConfig(root=str(tmp_path), staging={"compiled_pass": True}).staging.compiled_pass == "on"


def test_the_kernel_module_is_not_imported_by_the_core() -> None:
    """numba costs a third of a second of GIL: ``import fastckpt`` must not import it (the warm-up does)."""
    import subprocess
    import sys

    code = "import sys, fastckpt; print('numba' in sys.modules, 'fastckpt.format.fusedkernels' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out


def test_scratch_is_per_thread(kernel) -> None:
    import threading

    mine = kernel.scratch()
    other: list[np.ndarray] = []
    t = threading.Thread(target=lambda: other.append(kernel.scratch()))
    t.start()
    t.join()
    assert other[0] is not mine and kernel.scratch() is mine


def test_a_torch_file_takes_the_compiled_pass_for_its_zip_crcs(tmp_path, kernel, monkeypatch) -> None:
    """A torch file (Lightning's ``.ckpt``): the I/O workers measure its records and take their zip CRC-32 in one
    compiled call a shard; the zip's CRC checks pass, it loads bit for bit, its health equals the batched pass's."""
    import zipfile

    from fastckpt.format.torchfile import verify_torch_file

    calls: list[tuple[str, bool]] = []
    real = fused.run

    def spy(*args: Any, **kwargs: Any) -> Any:
        got = real(*args, **kwargs)
        calls.append((kwargs.get("checksum", "crc32c"), got is not None))
        return got

    monkeypatch.setattr(fused, "run", spy)
    torch.manual_seed(4)
    state = {"w": torch.randn(300_007), "b": torch.randn(70_001).bfloat16(), "h": torch.randn(9, 5).half(),
             "step": torch.tensor(3), "e": torch.empty(0)}
    want = clone_state(state)
    for mode in ("on", "off"):
        monkeypatch.setattr(fused, "kernel", (lambda m, n: kernel) if mode == "on" else (lambda m, n: None))
        with Checkpointer(CheckpointConfig(root=str(tmp_path / mode), persist={"chunk_bytes": 1 << 16})) as ck:
            ck.save_file(state, "a.ckpt", step=1).wait()
        path = tmp_path / mode / "a.ckpt"
        with zipfile.ZipFile(path) as z:
            assert z.testzip() is None  # every record's CRC-32 is right
        assert verify_torch_file(str(path)) == []
        assert_bit_equal(want, torch.load(path, weights_only=True))
        if mode == "on":
            assert calls and all(ok and name == "crc32" for name, ok in calls), calls
    from fastckpt.format.health import file_health
    from fastckpt.storage.local import LocalStorage

    on, off = (file_health(LocalStorage(str(tmp_path / m)), str(tmp_path / m / "a.ckpt")) for m in ("on", "off"))
    assert on is not None and off is not None and on["healthy"] and on.keys() == off.keys()


def test_a_damaged_kernel_cache_is_compiled_afresh(tmp_path) -> None:
    """Garbage planted over numba's cache files of the kernel (a disk error, a hostile write): numba raises on them
    instead of compiling again; the warm-up's child removes them and compiles, and the kernel is ready."""
    import shutil
    import subprocess
    import sys

    pkg = Path(fused.__file__).resolve().parent.parent
    copy = tmp_path / "fastckpt"
    shutil.copytree(pkg, copy, ignore=shutil.ignore_patterns("*.pyc"))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from fastckpt.format import fused; "
            "print(fused.warm('on').result(timeout=600) is not None, fused.state())")
    first = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert first.stdout.startswith("True"), first.stdout + first.stderr
    cached = list((copy / "format" / "__pycache__").glob("fusedkernels.*.nb*"))
    assert cached, "no cache files next to the kernel's module"
    for f in cached:
        f.write_bytes(os.urandom(200))
    again = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert again.stdout.startswith("True"), again.stdout + again.stderr
    assert "RuntimeWarning" not in again.stderr, again.stderr
