"""Issue 53: the batched pass (format/batchpass.py) and the serial background threads it needs (engine/serialops.py).

The batched pass must give what the blocked pass gives, tensor for tensor: the staged bytes equal the sources, the
CRC32C bit for bit, ``n``/``nan``/``inf``/``absmax``/``fp`` exactly and ``l2`` within 1e-6 of float64 over every
finite value, for shards mixing every dtype a checkpoint holds, sizes around the group and the piece, tensors cut
across pieces, NaN/Inf and squares beyond float32. And it must do so in a few native calls a piece, not a few a
tensor: the count of torch/ctypes/crc32c calls the copy thread makes per checkpoint is bounded by the pieces and
shards, whatever the number of tensors (each call is a GIL hand-over a launch-bound training thread pays for).
"""
from __future__ import annotations

import ctypes
import random
import threading
from collections import Counter
from typing import Any

import pytest
import torch

import fastckpt.format.batchpass as batchpass
import fastckpt.format.fused as fused
from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.engine.serialops import is_serial, serial_here
from fastckpt.format.checksum import crc32c
from fastckpt.format.healthpass import GROUP
from fastckpt.format.plan import TensorEntry
from tests import passpaths
from tests.helpers import assert_bit_equal, clone_state
from tests.test_healthpass import _random, _reference

_DTYPES = [torch.float32] * 4 + [torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool,
                                 torch.complex64, torch.float8_e4m3fn]
_SIZES = [0, 1, 5, GROUP - 1, GROUP, GROUP + 3, 3 * GROUP, 5000, 70_000, 300_001]


def _shard(rng: random.Random) -> tuple[list[torch.Tensor], list[TensorEntry], torch.Tensor]:
    """Sources of random dtypes and sizes (some with a NaN, an Inf or a value whose square overflows float32),
    laid out as format/plan.py lays a shard (widest dtype first, back to back), and a zeroed buffer for them."""
    srcs = []
    for dtype in rng.choices(_DTYPES, k=rng.randint(1, 12)):
        t = _random(rng.choice(_SIZES), dtype)
        if dtype.is_floating_point and t.numel() and dtype.itemsize > 1:
            kind = rng.choice(["ok"] * 6 + ["nan", "inf", "big"])
            at = rng.randrange(t.numel())
            if kind == "nan":
                t[at] = float("nan")
            elif kind == "inf":
                t[at] = float("-inf")
            elif kind == "big" and dtype in (torch.float32, torch.float64):
                t[at] = 3e20
        srcs.append(t)
    return laid_out(srcs)


def laid_out(srcs: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[TensorEntry], torch.Tensor]:
    """``srcs`` laid out as format/plan.py lays a shard (widest dtype first, back to back), and a zeroed buffer."""
    order = sorted(range(len(srcs)), key=lambda i: (-srcs[i].element_size(), i))
    entries: list[Any] = [None] * len(srcs)
    offset = 0
    for i in order:
        nbytes = srcs[i].numel() * srcs[i].element_size()
        entries[i] = TensorEntry(i, srcs[i].dtype, tuple(srcs[i].shape), nbytes, True, 0, offset)
        offset += nbytes
    return srcs, entries, torch.zeros(offset, dtype=torch.uint8)


@pytest.mark.parametrize("piece", [4096, 1 << 14, 1 << 16, 32 << 20])
@pytest.mark.parametrize("seed", range(6))
def test_batched_pass_equals_the_reference_for_every_layout(monkeypatch, piece: int, seed: int) -> None:
    monkeypatch.setattr(batchpass, "PIECE", piece)  # small pieces cut tensors, and rows straddle the cuts
    srcs, entries, buf = _shard(random.Random(seed * 7919 + piece))
    lay = batchpass.Layout.of(buf, entries, [e.dtype for e in entries])

    def fill(parts: Any) -> None:
        for p in parts:
            e = lay.entries[p.pos]
            ctypes.memmove(buf.data_ptr() + e.offset + p.at, srcs[e.index].data_ptr() + p.at, p.n)

    crcs, stats = batchpass.run(lay, buf, checksum=crc32c, health=True, fill=fill)
    assert_reference(lay, buf, srcs, crcs, stats)


def assert_reference(lay: Any, buf: torch.Tensor, srcs: list[torch.Tensor], crcs: list[int],
                     stats: dict[int, dict[str, Any]]) -> None:
    """The staged bytes equal the sources, and each entry's CRC32C and statistics equal the reference's (exactly,
    ``l2`` within 1e-6): what every pass over a shard must give (also tests/test_fused_pass.py)."""
    for pos, e in enumerate(lay.entries):
        raw = buf[e.offset:e.offset + e.nbytes]
        src = srcs[e.index].reshape(-1)
        assert bytes(raw.numpy()) == (bytes(src.view(torch.uint8).numpy()) if e.nbytes else b""), e
        want = _reference(raw, e.dtype)
        assert crcs[pos] == want["crc"], e
        got = stats[pos]
        for field in ("n", "nan", "inf", "absmax", "fp"):
            assert got[field] == want[field], (field, e, got, want)
        if not want["l2"]:
            assert got["l2"] == want["l2"], (e, got, want)
        else:
            assert abs(got["l2"] - want["l2"]) / want["l2"] < 1e-6, (e, got, want)


def test_serial_here_is_the_calling_threads_alone() -> None:
    """A background thread made serial runs its torch reductions inline; the training thread and threads started
    later keep torch's width (no process-wide setting moved)."""
    width = torch.get_num_threads()
    seen: dict[str, Any] = {}

    def background() -> None:
        seen["took"] = serial_here()
        seen["serial"] = is_serial()

    t = threading.Thread(target=background)
    t.start()
    t.join()
    assert seen == {"took": True, "serial": True}
    later: list[int] = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == width and later == [width]


class _NativeCalls:
    """Counts, per thread kind, the calls into torch and ctypes (each releases the GIL and takes it back) made
    while ``active``; installed for the threads started after it (the Checkpointer's). CRC32C calls are left out:
    under ``batchpass.RELEASE`` bytes they keep the GIL, and above it there is one per large tensor."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.active = False
        threading.setprofile(self._profile)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if self.active and event == "c_call":
            owner = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__module__ or ""
            name = getattr(arg, "__qualname__", "")
            if owner.startswith(("torch", "ctypes")) or "Tensor" in name or "_VariableFunctions" in name:
                self.calls["-".join(threading.current_thread().name.split("-")[:2])] += 1


@pytest.mark.parametrize("path", passpaths.PATHS)
def test_the_copy_thread_makes_a_few_calls_a_piece_not_a_tensor(tmp_path, monkeypatch, path: str) -> None:
    """400 tensors (most small, as in a transformer: biases, norms) and a few large: on the batched path the copy
    thread's one pass makes fewer native calls than there are tensors; the blocked path makes several a tensor."""
    passpaths.use(monkeypatch, path)
    kernel_calls: list[bool] = []  # the compiled pass: one call a shard (each a GIL hand-over), None: not covered
    real_run = fused.run

    def counted(*args: Any, **kwargs: Any) -> Any:
        got = real_run(*args, **kwargs)
        if native.active:
            kernel_calls.append(got is not None)
        return got

    monkeypatch.setattr(fused, "run", counted)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in [768] * 396 + [1 << 20] * 4]
    opt = torch.optim.SGD(params, lr=0.1)
    state = {"p": {str(i): p.detach() for i, p in enumerate(params)}}
    want = clone_state(state)
    native = _NativeCalls()
    try:
        with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"chunk_bytes": 8 << 20})) as ck:
            ck.watch(opt)
            ck.save(state, 1).wait()  # the first save makes the buffers and the layouts
            native.active = True
            handle = ck.save(state, 2)
            assert handle._staged.wait(60) and not handle.hurry.is_set()  # the one pass, unhurried
            native.active = False
            handle.wait()
            assert_bit_equal(want, ck.load(2))
    finally:
        threading.setprofile(None)
    copy = native.calls["fastckpt-copy"]
    if path == "compiled":  # the tensors' accessors (no GIL release) are counted too: the kernel calls are the bound
        assert kernel_calls and all(kernel_calls) and len(kernel_calls) <= 4, kernel_calls  # 4 shards of 8 MiB
    elif path == "batched":
        assert not kernel_calls
        assert 0 < copy < len(params) // 4, dict(native.calls)
    else:
        assert copy > 2 * len(params), dict(native.calls)  # the contrast: the bound above can fail


def _saved(root, monkeypatch, path: str) -> tuple[dict, dict, Any]:
    """One lazy save, one pass, of tensors larger than a piece (cut across pieces) and a transposed view of one
    (not plain: the batched copy resolves its strides): the manifest's health record, what was saved, what loads."""
    import json

    monkeypatch.setattr(batchpass, "PIECE", 1 << 16)
    passpaths.use(monkeypatch, path)
    torch.manual_seed(5)
    big, odd = torch.nn.Parameter(torch.randn(300, 700)), torch.nn.Parameter(torch.randn(100_003))
    opt = torch.optim.SGD([big, odd], lr=0.1)
    state = {"big": big.detach(), "big_t": big.detach().t(), "odd": odd.detach()}
    want = clone_state(state)
    with Checkpointer(CheckpointConfig(root=str(root), persist={"chunk_bytes": 1 << 20})) as ck:
        ck.watch(opt)
        handle = ck.save(state, 1)
        assert handle.wait_copied(60) and not handle.hurry.is_set()  # the one pass, unhurried
        handle.wait()
        got = ck.load(1)
    doc = json.loads((root / "step-000000001" / "manifest.json").read_text())
    return doc["health"], want, got


def test_the_batched_one_pass_cuts_large_tensors_and_measures_as_the_blocked_one(tmp_path, monkeypatch) -> None:
    """Through the engine: tensors cut across pieces are copied by memmove part by part, a transposed source by
    torch whole; both restore bit for bit, and the health record equals the blocked pass's (counts, extremes and
    fingerprints exact, L2 within 1e-6)."""
    batched, want, got = _saved(tmp_path / "batched", monkeypatch, "batched")
    assert_bit_equal(want, got)
    monkeypatch.undo()
    blocked, want, got = _saved(tmp_path / "blocked", monkeypatch, "blocked")
    assert_bit_equal(want, got)
    assert batched["tensors"].keys() == blocked["tensors"].keys() == {"big", "big_t", "odd"}
    for key, stats in blocked["tensors"].items():
        mine = batched["tensors"][key]
        assert {k: mine[k] for k in ("n", "nan", "inf", "absmax", "fp")} == \
            {k: stats[k] for k in ("n", "nan", "inf", "absmax", "fp")}, key
        assert abs(mine["l2"] - stats["l2"]) <= 1e-6 * stats["l2"], key


def _rows_only(lay: batchpass.Layout) -> batchpass.Layout:
    """``lay`` measured as before issue 53's single-entry pieces: every piece's extremes row by row."""
    for piece in lay.pieces:
        piece.extremes = piece.flat = None
    for s in lay.stretches:
        s.pmin = s.pmax = None
        s.powners = []
    return lay


@pytest.mark.parametrize("piece", [4096, 1 << 14, 1 << 16])
@pytest.mark.parametrize("seed", range(4))
def test_one_entrys_pieces_give_todays_statistics_bit_for_bit(monkeypatch, piece: int, seed: int) -> None:
    """A piece whose rows all belong to one tensor takes its extremes in one ``aminmax`` over the piece (one pass,
    one call, not a max and a min per row): every statistic, ``l2`` included, and every CRC equal the row by row
    pass's bit for bit, NaN, Inf and float32-overflowing squares among them."""
    monkeypatch.setattr(batchpass, "PIECE", piece)
    srcs, entries, buf = _shard(random.Random(seed * 104729 + piece))
    big = _random(200_000, torch.float32)  # many pieces of its own rows whatever the piece
    if seed % 2:  # a NaN or an Inf in a piece of its own: the whole tensor is measured by the blocked pass
        big[150_000] = float("nan") if seed == 1 else float("inf")
    srcs.append(big)
    at = -(-buf.numel() // 64) * 64  # aligned: a stretch of its own
    entries.append(TensorEntry(len(srcs) - 1, big.dtype, tuple(big.shape), big.numel() * 4, True, 0, at))
    buf = torch.zeros(at + big.numel() * 4, dtype=torch.uint8)
    for e, src in zip(entries, srcs):
        if e.nbytes:
            buf[e.offset:e.offset + e.nbytes] = src.reshape(-1).view(torch.uint8)
    dtypes = [e.dtype for e in entries]
    lay = batchpass.Layout.of(buf, entries, dtypes)
    assert sum(p.extremes is not None for p in lay.pieces) >= 2  # the path under test is taken
    crcs, stats = batchpass.run(lay, buf, checksum=crc32c, health=True)
    old_crcs, old = batchpass.run(_rows_only(batchpass.Layout.of(buf, entries, dtypes)), buf, checksum=crc32c,
                                  health=True)
    assert crcs == old_crcs
    assert stats == old  # n, nan, inf, absmax, l2 and fp: the same floats
