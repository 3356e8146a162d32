"""The seal's sampled bytes (fastckpt/engine/seal.py), unit by unit: which bytes are compared, bit for bit, on every
dtype, against the sources at the seal and against the staged copy.

The Checkpointer-level tests (a ``.data`` write right after save(), an EMA swap during the copy, retakes) are in
tests/test_seal.py; these drive ``Seal`` directly, with a staged buffer laid out as the copy thread lays it out.
"""
from __future__ import annotations

import pytest
import torch

from fastckpt.engine import seal as seal_mod
from fastckpt.engine.seal import BUDGET, PAGE, RUN, WHOLE, Seal, stride_for
from fastckpt.format.plan import TensorEntry


class _NoCounter:
    """The version guard's part of the seal: no counter moved (the writes here all skip it)."""

    def moved(self) -> list[int]:
        return []


def _entries(tensors: list[torch.Tensor]) -> list[TensorEntry]:
    out, at = [], 0
    for i, t in enumerate(tensors):
        out.append(TensorEntry(index=i, dtype=t.dtype, shape=tuple(t.shape), nbytes=t.nbytes, lazy=True, offset=at))
        at += -(-t.nbytes // 64) * 64  # the staged buffer aligns each tensor, as the plan does
    return out


def _stage(tensors: list[torch.Tensor], entries: list[TensorEntry]) -> torch.Tensor:
    """The tensors' bytes as the copy thread stages them: one flat uint8 buffer, each at its entry's offset."""
    buf = torch.zeros(entries[-1].offset + entries[-1].nbytes + 64, dtype=torch.uint8)
    for t, e in zip(tensors, entries):
        if t.is_contiguous():
            buf[e.offset:e.offset + e.nbytes] = t.detach().reshape(-1).view(torch.uint8)
        else:
            buf[e.offset:e.offset + e.nbytes] = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return buf


def _seal(tensors: list[torch.Tensor]) -> tuple[Seal, list[TensorEntry]]:
    entries = _entries(tensors)
    return Seal(_NoCounter(), list(tensors), [f"t{i}" for i in range(len(tensors))], entries), entries  # type: ignore[arg-type]


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A byte view of ``t`` that shares its memory but not its version counter (as ``.data`` does)."""
    return t.data.reshape(-1).view(torch.uint8)


def _sampled_bytes(s: Seal, index: int, nbytes: int) -> list[int]:
    """The byte positions of tensor ``index`` its seal compares (from the seal's own record of its runs)."""
    run = s._runs[index]
    line = run.per * run.size
    return [run.start * run.size + j * run.step * run.size + k for j in range(run.count) for k in range(line)
            if run.start * run.size + j * run.step * run.size + k < nbytes]


_BIG = WHOLE // 4 * 5  # elements: over WHOLE bytes for every dtype here, so sampled by lines


def _every_dtype() -> list[torch.Tensor]:
    torch.manual_seed(0)
    out = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64,
                  torch.uint8, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.uint16):
        for n in (3, _BIG):
            size = torch.empty((), dtype=dtype).element_size()
            out.append(torch.randint(0, 120, (n * size,), dtype=torch.uint8).view(dtype))
    nan = torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345 - (1 << 32), 0x80000000 - (1 << 32)],
                       dtype=torch.int32).view(torch.float32)  # NaNs with payloads, a signalling NaN, -0.0
    out.append(nan.repeat(_BIG // 4))
    for n in (4000, 2 * WHOLE):  # compared whole, and by lines (a strided bool copy turns a 2 into a 1)
        flags = torch.zeros(n, dtype=torch.bool)
        flags.view(torch.uint8)[::7] = 2  # bytes a bool holds (written through a byte view) that a bool copy changes
        out.append(flags)
    out.append(torch.tensor(7.5))  # 0-dim: the optimizers' step counters
    out.append(torch.randn(3, 4, requires_grad=True))
    return out


def test_every_dtype_is_compared_bit_for_bit_without_a_false_alarm() -> None:
    tensors = _every_dtype()
    s, entries = _seal(tensors)
    assert sorted(s._runs) == list(range(len(tensors)))  # every one sampled
    s.record(_stage(tensors, entries), entries)
    s.recorded()
    assert s.moved() == [] and not s.pending() and s.verdict() == []


@pytest.mark.parametrize("at", ["first", "last", "middle"])
def test_a_write_into_any_sampled_line_is_found_at_the_seal(at: str) -> None:
    """One byte changed through ``.data`` (no counter moves), in a sampled line of every dtype's large tensor (its
    first, last or a middle line, at the line's first or last byte) and in every small tensor: each one is named."""
    tensors = _every_dtype()
    s, entries = _seal(tensors)
    s.record(_stage(tensors, entries), entries)
    s.recorded()
    for i, t in enumerate(tensors):
        where = _sampled_bytes(s, i, t.nbytes)
        pos = {"first": where[0], "last": where[-1], "middle": where[len(where) // 2]}[at]
        _raw(t)[pos] ^= 0x10
    assert sorted(s.moved(), key=lambda k: int(k[1:])) == [f"t{i}" for i in range(len(tensors))]


def test_only_the_sampled_lines_of_a_large_tensor_are_compared() -> None:
    """The geometry is what the seal says: lines of ``RUN`` bytes, aligned within the tensor, ``stride`` apart, at
    most ``BUDGET`` of them per save; a write between the lines is not seen (the documented limit: such sparse
    writes are likely, not certainly, caught), a write in one is."""
    torch.manual_seed(1)
    big = [torch.randn(3 * 1024 * 1024) for _ in range(8)]  # 96 MiB: the stride grows past a page
    s, entries = _seal(big)
    stride = stride_for(sum(t.nbytes for t in big))
    assert stride > PAGE and s._stride == stride
    lines = 0
    for i, t in enumerate(big):
        run = s._runs[i]
        first = run.start * run.size
        assert run.per * run.size == RUN and first % RUN == 0 and run.step * run.size == stride
        assert first + (run.count - 1) * stride + RUN <= t.nbytes < first + run.count * stride + RUN
        lines += run.count
    assert lines <= BUDGET
    s.record(_stage(big, entries), entries)
    s.recorded()
    run = s._runs[3]
    outside = run.start * run.size + RUN + 5  # past the first line, before the next
    _raw(big[3])[outside] ^= 1
    assert s.moved() == []
    _raw(big[3])[run.start * run.size + RUN - 1] ^= 1
    assert s.moved() == ["t3"]


def test_staged_bytes_that_differ_from_save_are_found_by_the_copy_thread() -> None:
    """The copy read a later write that was undone before the seal: the sources look untouched, the staged bytes
    do not. The copy thread compares as it records, so the training thread's seal only reads the answer."""
    tensors = _every_dtype()
    s, entries = _seal(tensors)
    buf = _stage(tensors, entries)
    for i in (1, 4, len(tensors) - 3):  # a large float32, a small float16, the large bools
        e = entries[i]
        buf[e.offset + _sampled_bytes(s, i, e.nbytes)[-1]] ^= 0x01
    s.record(buf, entries)
    s.recorded()
    assert s.moved() == ["t1", "t4", f"t{len(tensors) - 3}"]


def test_a_tensor_swapped_or_resized_after_save_is_named() -> None:
    """``t.data = other`` (a new storage, maybe a new shape or dtype) leaves no comparable bytes: named, not read."""
    tensors = [torch.randn(_BIG), torch.randn(100), torch.randn(100), torch.randn(_BIG)]
    s, entries = _seal(tensors)
    s.record(_stage(tensors, entries), entries)
    s.recorded()
    tensors[0].data = torch.randn(_BIG // 2)
    tensors[1].data = tensors[1].data.to(torch.float64)
    tensors[2].data = tensors[2].data.t().contiguous().expand(2, 100).t()  # no longer contiguous
    assert sorted(s.moved()) == ["t0", "t1", "t2"]


def test_the_seal_reads_the_views_of_save_while_the_sources_hold_their_memory(monkeypatch) -> None:
    """No window is built again at the seal while every source holds the memory of save() (the windows then show
    its bytes now): a write through ``.data`` into a sampled line is still found, in a large and a small tensor."""
    tensors = [torch.randn(_BIG), torch.randn(100), torch.randn(_BIG, dtype=torch.float64)]
    s, entries = _seal(tensors)
    s.record(_stage(tensors, entries), entries)
    s.recorded()

    def no_window(*_a, **_k):
        raise AssertionError("a window was built again at the seal")

    monkeypatch.setattr(seal_mod, "_window", no_window)
    assert s.moved() == []
    _raw(tensors[0])[_sampled_bytes(s, 0, tensors[0].nbytes)[-1]] ^= 0x04
    _raw(tensors[1])[7] ^= 0x01
    assert sorted(s.moved()) == ["t0", "t1"]


def test_a_source_moved_to_other_memory_is_compared_through_a_new_window() -> None:
    """``t.data = other`` of the same size: its new memory is compared (built anew), equal values pass, different
    ones are named; the other tensors, still in their memory, are read through save()'s views as usual."""
    torch.manual_seed(3)
    tensors = [torch.randn(_BIG), torch.randn(_BIG), torch.randn(100)]
    s, entries = _seal(tensors)
    s.record(_stage(tensors, entries), entries)
    s.recorded()
    tensors[0].data = tensors[0].data.clone()  # other memory, the same bytes
    assert s.moved() == []
    tensors[1].data = tensors[1].data + 1  # other memory, other bytes
    _raw(tensors[2])[0] ^= 0x01
    assert sorted(s.moved()) == ["t1", "t2"]


def test_a_copy_still_running_at_the_seal_is_left_to_the_verdict() -> None:
    """A CPU tensor whose staged bytes the copy thread has not compared yet (its shard also holds CUDA tensors, copied
    after the seal): the seal leaves it pending and ``verdict()`` waits for the copy thread's answer."""
    tensors = [torch.randn(100), torch.randn(_BIG)]
    s, entries = _seal(tensors)
    assert s.moved() == [] and s.pending()
    buf = _stage(tensors, entries)
    buf[entries[0].offset] ^= 1  # the copy read a write that was undone before the seal
    s.record(buf, entries)
    s.recorded()
    assert s.verdict() == ["t0"] and not s.pending()


def test_a_non_contiguous_or_empty_tensor_is_left_to_the_version_counter() -> None:
    tensors = [torch.randn(8, 8).t(), torch.empty(0), torch.randn(4, dtype=torch.complex64).conj(), torch.randn(5)]
    s, _ = _seal(tensors)
    assert sorted(s._runs) == [3]


def test_cpu_samples_are_gathered_from_memory_without_a_torch_call_per_tensor(monkeypatch) -> None:
    """The reason for the numpy gather (engine/hostsamples.py): views and a ``cat`` per dtype still cost two or three
    torch calls a tensor, 3-4 ms of a 588-tensor save(). CPU tensors get no window and no ``cat``, at save() or at the
    seal, and a write through ``.data`` into any of them is still found."""
    calls: list[int] = []
    real = torch.cat
    monkeypatch.setattr(seal_mod.torch, "cat", lambda ts, *a, **k: (calls.append(len(ts)), real(ts, *a, **k))[1])

    def no_window(*_a, **_k):
        raise AssertionError("a torch view was built for a CPU tensor")

    monkeypatch.setattr(seal_mod, "_window", no_window)
    tensors = [torch.randn(100) for _ in range(300)] + [torch.randn(_BIG) for _ in range(20)]
    tensors += [torch.randn(10, dtype=torch.float64) for _ in range(50)] + [torch.tensor(3.0) for _ in range(5)]
    s, entries = _seal(tensors)
    s.record(_stage(tensors, entries), entries)
    s.recorded()
    assert s.moved() == [] and calls == []
    for i in (0, 299, 300, 319, 320, 374):  # whole, whole, lines, lines, whole f64, a 0-dim step counter
        _raw(tensors[i])[_sampled_bytes(s, i, tensors[i].nbytes)[-1]] ^= 0x08
    assert s.moved() == ["t0", "t299", "t300", "t319", "t320", "t374"] and calls == []


def test_a_dtype_cat_lacks_on_the_device_goes_as_integers(monkeypatch) -> None:
    """Float8 and the newer unsigned types have no ``cat`` on some devices: their samples (gathered by ``cat`` on a
    device; CPU ones are read from memory) go as integers of their size, still bit for bit."""
    real = torch.cat

    def no_float8(ts, *a, **k):
        if ts[0].dtype in (torch.float8_e4m3fn, torch.uint16):
            raise NotImplementedError(f"cat has no kernel for {ts[0].dtype} (simulated)")
        return real(ts, *a, **k)

    monkeypatch.setattr(seal_mod.torch, "cat", no_float8)
    for dtype in (torch.float8_e4m3fn, torch.uint16):
        size = torch.empty((), dtype=dtype).element_size()
        views = [torch.randint(0, 255, (n * size,), dtype=torch.uint8).view(dtype) for n in (3, 100)]
        got = seal_mod._cat(views)
        assert got.dtype == torch.uint8
        assert torch.equal(got, torch.cat([v.view(torch.uint8) for v in views]))


def test_a_shard_smaller_than_a_line_is_compared_byte_by_byte() -> None:
    """A shard holding only tensors under a line (0-dim step counters) is staged in a buffer smaller than a line:
    its bytes are compared, and the line-sized views of the other tensors' groups are not made over it."""
    tensors = [torch.randn(_BIG), torch.tensor(3.0), torch.tensor(4.0)]
    entries = [TensorEntry(index=0, dtype=torch.float32, shape=(_BIG,), nbytes=4 * _BIG, lazy=True, shard=0),
               TensorEntry(index=1, dtype=torch.float32, shape=(), nbytes=4, lazy=True, shard=1, offset=0),
               TensorEntry(index=2, dtype=torch.float32, shape=(), nbytes=4, lazy=True, shard=1, offset=4)]
    big = tensors[0].reshape(-1).view(torch.uint8).clone()
    small = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors[1:]])  # 8 bytes: under one line
    for staged_small, moved in ((small, []), (small.clone().index_put_((torch.tensor([5]),), torch.tensor(9,
                                                                       dtype=torch.uint8)), ["t2"])):
        s = Seal(_NoCounter(), list(tensors), ["t0", "t1", "t2"], entries)  # type: ignore[arg-type]
        s.record(big, entries[:1])
        s.record(staged_small, entries[1:])
        s.recorded()
        assert s.moved() == moved


def test_the_lines_drawn_from_the_precomputed_candidates_are_those_the_counts_give() -> None:
    """``_LinePlan`` lays each large tensor's candidate lines out once per layout and a save only adds its first lines
    and drops the candidates past a tensor's end: for any draw, tensors around and far above the stride, the lines
    (where each is read in save(); positions, owners, ends, derived after it) are exactly those derived from the
    first lines and counts."""
    import random

    import numpy as np

    from fastckpt.engine.hostsamples import _LinePlan, _positions

    class Group:  # what _LinePlan reads of a _Group: sizes and where each tensor starts in the memory view
        def __init__(self, nbytes: list[int], at: list[int]) -> None:
            self.nbytes, self.at = np.array(nbytes, dtype=np.int64), np.array(at, dtype=np.int64)

    rng = random.Random(0)
    for _ in range(200):
        stride = PAGE << rng.randrange(8)
        sizes = [rng.choice([rng.randrange(WHOLE + 1, WHOLE + 3 * stride), rng.randrange(WHOLE + 1, 40 * stride)])
                 for _ in range(rng.randrange(12))]
        g = Group(sizes, sorted(rng.randrange(1 << 40) for _ in sizes))
        plan = _LinePlan(g, stride)  # type: ignore[arg-type]
        for _ in range(20):
            shift = rng.randrange(stride)
            first = (shift % (g.nbytes - RUN + 1)) & -RUN
            at = _positions(first, (g.nbytes - RUN - first) // stride + 1, stride, g.nbytes - RUN)
            got_first, got_idx, keep = plan.draw(shift)
            assert np.array_equal(got_first, first)
            assert np.array_equal(got_idx, at[0] + g.at[at[1]])
            assert all(np.array_equal(a, b) for a, b in zip(plan.positions(got_first, got_idx, keep), at))


def test_a_whole_tensor_is_read_by_wide_records_and_every_byte_of_it_is_compared() -> None:
    """Whole tensors (up to ``WHOLE`` bytes) are gathered by records of the widest power of two from a line to 16 KiB
    they hold, the last one ending at the tensor's end (numpy copies record by record: 64-byte ones made W1's small
    tensors 22,752 records). Every byte is still compared: a change of any byte of any of them, whatever its size
    (odd sizes leave a last record overlapping the one before), is named at the seal and in the staged copy."""
    from fastckpt.engine.hostsamples import HostSamples

    torch.manual_seed(2)
    sizes = [16, 100, 700, 2304, 3000, 5000, 16384]  # float32 elements: 64 B ... WHOLE
    tensors = [torch.randn(n) for n in sizes]
    s, entries = _seal(tensors)
    host: HostSamples = s._host  # type: ignore[assignment]
    widths = {i: g.dtype.itemsize for g in host.layout.wholes for i in g.index}
    assert widths == {0: 64, 1: 256, 2: 1024, 3: 4096, 4: 4096, 5: 16384, 6: 16384}
    assert sum(len(at[0]) for at in host._at[:len(host.layout.wholes)]) < sum(t.nbytes for t in tensors) // 256
    buf = _stage(tensors, entries)
    s.record(buf, entries)
    s.recorded()
    assert s.moved() == [] and s.verdict() == []
    for i, t in enumerate(tensors):
        n, w = t.nbytes, widths[i]
        for pos in sorted({0, 63, 64, w - 1, w, n // 2, n - w - 1, n - w, n - 1} & set(range(n))):
            _raw(t)[pos] ^= 0x20
            assert s.moved() == [f"t{i}"], (i, pos)
            _raw(t)[pos] ^= 0x20
            staged = buf.clone()
            staged[entries[i].offset + pos] ^= 0x20
            again, _ = _seal(tensors)
            again.record(staged, entries)
            again.recorded()
            assert again.verdict() == [f"t{i}"], (i, pos)
    assert s.moved() == []
