"""The seal's samples of CPU tensors (engine/seal.py), read from their memory by one numpy gather for all of them.

Which bytes are compared is seal.py's geometry: a tensor of up to ``WHOLE`` bytes whole, a larger one by runs of
one ``RUN``-byte cache line every ``stride`` bytes from a line drawn per save. Taking them as torch views cost two
or three torch calls a tensor (a view or an ``as_strided``, the checks of ``_window``) and a ``torch.cat`` per dtype:
3-4 ms of a 588-tensor ``save()`` on the 2-core benchmark host, each call a GIL hand-over. Here the positions are
numpy arrays (byte offsets of lines), derived once per structure where format/flatcache.py certifies the same
tensors at the same addresses (``HostLayout``), and per save only for the large tensors' lines (a few vectorized
numpy operations on ~4,000 positions, whatever the number of tensors). The bytes are then gathered by one numpy
index per kind of position from a read-only numpy view of this process's memory: a large tensor's lines as 64-byte
records, a whole tensor as records of the widest power of two from 64 bytes to 16 KiB it holds (its last record ends
at its last byte, so a tensor is read only within its bytes: numpy copies record by record, and wider records made
the gather of W1's small tensors a third cheaper), tensors under a line byte by byte.

Reading memory by address is safe here for the reason the copy thread's ``memmove`` of the same tensors is
(engine/staging.py): every address read is that of a live CPU tensor held by the caller, read while it is held,
contiguous, its ``nbytes`` exactly its values (no conj or neg bit). ``save()`` reads the state's tensors during the
call; the seal reads the sources it holds (``HostSamples.tensors``) at their *current* addresses, so a source moved
to other memory (``.data = other``) is read where it now is, never where it was (that memory may be freed). The
copy thread compares the staged buffer, which it owns, with the gathered bytes: no source is read there.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from ..format.plan import TensorEntry

__all__ = ["RUN", "WHOLE", "HostLayout", "HostSamples", "plain_host"]

RUN = 64  # bytes per sample run: one cache line (a multiple of every element size)
WHOLE = 64 * 1024  # tensors up to this size are compared whole

_T = torch._C.TensorBase
_ptr = _T.data_ptr
_nbytes = operator.attrgetter("nbytes")
_LINE = np.dtype(f"V{RUN}")
_WIDTHS = (RUN, 256, 1024, 4096, 16384)  # the records whole tensors are read by (powers of two from a line)
_BYTE = np.dtype(np.uint8)


def plain_host(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes in CPU memory are exactly its values (what the gather reads)."""
    return (t.device.type == "cpu" and t.layout is torch.strided and not t.is_quantized and t.is_contiguous()
            and not (t.dtype.is_complex and t.is_conj()) and not t.is_neg() and t.numel() > 0)


class _Memory:
    """A read-only numpy view of this process's memory: records of ``dtype`` (a line, or a byte), one starting at
    every byte from ``base``, ``count`` of them (record i holds the bytes base+i .. base+i+itemsize-1)."""

    def __init__(self, base: int, count: int, dtype: np.dtype) -> None:
        self.__array_interface__ = {"data": (base, True), "shape": (count,), "strides": (1,),
                                    "typestr": dtype.str, "version": 3}


def _read(addr: np.ndarray, nbytes: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, int]:
    """A view of the memory spanning tensors at ``addr`` of ``nbytes``, and its base address."""
    base = int(addr.min())
    count = int((addr + nbytes).max()) - base - dtype.itemsize + 1
    return np.asarray(_Memory(base, count, dtype)), base


def _positions(first: np.ndarray, counts: np.ndarray, step: np.ndarray | int, last: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each tensor's ``counts`` positions ``first + k * step``, none past ``last`` (concatenated, in tensor order),
    the tensor each belongs to, and where each tensor's positions end."""
    ends = np.cumsum(counts)
    owner = np.repeat(np.arange(len(counts)), counts)
    k = np.arange(int(ends[-1]) if len(ends) else 0) - (ends - counts)[owner]
    step_of = step[owner] if isinstance(step, np.ndarray) else step
    return np.minimum(first[owner] + k * step_of, last[owner]), owner, ends


class _Group:
    """Tensors sampled alike, in entry order: whole ones by records of one width (a line or wider), large ones by
    lines a stride apart, those under a line by bytes."""

    def __init__(self, picks: list[tuple[int, int, TensorEntry]], dtype: np.dtype) -> None:
        self.index = [i for i, _, _ in picks]
        self.pos = {i: k for k, i in enumerate(self.index)}
        self.addr = np.array([a for _, a, _ in picks], dtype=np.int64)
        self.nbytes = np.array([e.nbytes for _, _, e in picks], dtype=np.int64)
        self.offset = np.array([e.offset for _, _, e in picks], dtype=np.int64)
        self.itemsize = [e.dtype.itemsize for _, _, e in picks]
        self.dtype = dtype
        self.memory, base = _read(self.addr, self.nbytes, dtype) if picks else (None, 0)
        self.at = self.addr - base  # each tensor's start in ``memory``

    def fixed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The positions of a whole group: every record (the last one ending at the tensor's end), or every byte."""
        width = self.dtype.itemsize
        counts = -(-self.nbytes // width)
        return _positions(np.zeros_like(self.nbytes), counts, width, self.nbytes - width)


class HostLayout:
    """Where a save samples its CPU tensors: derived once per structure and plan (format/flatcache.py certifies
    that a later state holds the same tensors at the same addresses), reused by every save of it."""

    def __init__(self, picks: list[tuple[int, torch.Tensor, TensorEntry]], stride: int) -> None:
        """``picks``: (index, source, entry) of each CPU tensor to sample (``plain_host``, ``nbytes`` its entry's), in
        entry order; ``stride``: the bytes between two sampled lines of a large tensor."""
        self.stride = stride
        self.order = [i for i, _, _ in picks]
        self.rank = {i: k for k, i in enumerate(self.order)}  # moved indices are named in entry order
        self.ptrs = [t.data_ptr() for _, t, _ in picks]  # what the seal checks its sources still hold
        self.sizes = [e.nbytes for _, _, e in picks]
        self.pick: Callable[[Sequence[Any]], list[Any]] = _picker(self.order)
        addressed = [(i, p, e) for (i, _, e), p in zip(picks, self.ptrs)]
        whole = [x for x in addressed if RUN <= x[2].nbytes <= WHOLE]
        # whole tensors by records of the widest of _WIDTHS they hold (the last ending at the tensor's end): a gather
        # copies record by record, and 64-byte ones made the 1.46 MB of W1's 294 small tensors 22,752 of them
        # (~0.24 ms of save() after a training step on the 2-core benchmark host); 882 of 1 and 4 KiB, ~0.17 ms
        widths = [max(w for w in _WIDTHS if w <= e.nbytes) for _, _, e in whole]
        self.wholes = [_Group([x for x, at in zip(whole, widths) if at == w], np.dtype(f"V{w}"))
                       for w in _WIDTHS if w in widths]
        self.lines = _Group([x for x in addressed if x[2].nbytes > WHOLE], _LINE)
        self.bytes = _Group([x for x in addressed if x[2].nbytes < RUN], _BYTE)
        self.groups = [*self.wholes, self.lines, self.bytes]  # the order of a save's samples
        # where save() reads the fixed groups (all but the lines), in their memory views: the same for every save
        self._n_whole = len(self.wholes)  # the lines' place in ``groups``: drawn per save
        self._fixed: list[Any] = [g.fixed() if g is not self.lines else None for g in self.groups]
        self._fixed_idx: list[Any] = [None if at is None else at[0] + g.at[at[1]]
                                      for g, at in zip(self.groups, self._fixed)]
        self._lines = _LinePlan(self.lines, stride)

    def take(self, shift: int, tensors: Sequence[Any]) -> HostSamples:
        """The samples of a save, drawn at ``shift``, gathered now from ``tensors`` (the state's, indexed by entry)."""
        first, lines_idx, keep = self._lines.draw(shift)
        idx = self._fixed_idx[:]
        idx[self._n_whole] = lines_idx
        # a copy of the list, not a gather of the sampled ones: the seal picks them (one C-level call, here or there)
        return HostSamples(self, first, keep, idx, list(tensors))

    def positions(self, first: np.ndarray, idx: list[np.ndarray], keep: np.ndarray | None
                  ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per group, (positions within each tensor, owner of each, where each tensor's end) of a save drawn as
        ``take`` drew it: what the comparisons after ``save()`` need, derived there (``HostSamples._at``)."""
        at = self._fixed[:]
        at[self._n_whole] = self._lines.positions(first, idx[self._n_whole], keep)
        return at


class _LinePlan:
    """The lines of the large tensors, for any draw: each tensor's first line is ``(shift % (nbytes - RUN + 1)) &
    -RUN`` (a tensor shorter than the stride still gets one line), then one every ``stride`` bytes up to its last
    line. ``shift`` is below the stride, so a tensor over the stride has its first line below the stride and ``M`` or
    ``M - 1`` lines, ``M`` those of a first line at 0; a shorter one has one line (``M`` = 1). The ``M`` candidate
    positions of every tensor are laid out once here; a draw adds its first lines and drops the candidates past a
    tensor's last line (its last one, where the first line is above ``slack``): four numpy operations in ``save()``,
    six where one is dropped, where deriving them from the counts (``_positions``) took twenty and a ``repeat``
    (~0.15 ms of ``save()`` after a training step on the 2-core benchmark host). The positions within each tensor
    and the counts, which only the comparisons after ``save()`` read, are derived there (``positions``)."""

    def __init__(self, g: _Group, stride: int) -> None:
        self.stride = stride
        self.span = g.nbytes - RUN + 1
        self.last = g.nbytes - RUN  # each tensor's last line
        most = self.last // stride + 1  # ``M``: the lines of a first line at 0
        self.slack = self.last - (most - 1) * stride  # a first line above it leaves M - 1 lines
        self.step, self.owner, _ = _positions(np.zeros_like(most), most, stride, self.last)  # k * stride, and whose
        self.at = g.at  # each tensor's start in the group's memory view
        self.read_at = self.step + g.at[self.owner]  # each candidate in the memory view, for a first line at 0
        self.limit = self.last[self.owner] + g.at[self.owner]  # each candidate's tensor's last line in the view

    def draw(self, shift: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Each tensor's first line, where each line is in the group's memory view, and which candidates are kept
        (None: all of them): ``_positions`` of these first lines and counts, exactly."""
        first = (shift % self.span) & -RUN
        idx = first[self.owner] + self.read_at
        if not (first > self.slack).any():  # (empty arrays: nothing above)
            return first, idx, None
        keep = idx <= self.limit
        return first, idx[keep], keep

    def positions(self, first: np.ndarray, idx: np.ndarray, keep: np.ndarray | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(positions within each tensor, owner of each, where each tensor's end) of a draw."""
        owner = self.owner if keep is None else self.owner[keep]
        return idx - self.at[owner], owner, ((self.last - first) // self.stride + 1).cumsum()


def _picker(order: list[int]) -> Callable[[Sequence[Any]], list[Any]]:
    if len(order) > 1:
        get = operator.itemgetter(*order)
        return lambda xs: list(get(xs))
    return lambda xs: [xs[i] for i in order]


class HostSamples:
    """One save's samples of its CPU tensors: the bytes of save() (``then``), compared with the staged copy by the
    copy thread (``record``) and with the sources at the seal (``moved``)."""

    def __init__(self, layout: HostLayout, first: np.ndarray, keep: np.ndarray | None, idx: list[np.ndarray],
                 tensors: list[torch.Tensor | None]) -> None:
        self.layout = layout
        self.order = layout.order
        self._first = first  # each large tensor's first sampled line, this save
        self._keep = keep  # the large tensors' candidate lines drawn (None: all)
        self._groups = layout.groups
        self._positions: list[tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None
        self._idx = idx  # per group: where save() read each record in the group's memory view
        self.then = [g.memory[i] if len(i) else np.empty(0, g.dtype) for g, i in zip(self._groups, idx)]
        # the state's tensors (by table index), held until the seal lets go: their memory stays valid
        self.tensors: list[torch.Tensor | None] | None = tensors

    @property
    def _at(self) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per group: (positions within each tensor, owner of each, where each tensor's end); derived at the first
        comparison, after ``save()`` (the copy thread and the seal may both derive it: the same value)."""
        if self._positions is None:
            self._positions = self.layout.positions(self._first, self._idx, self._keep)
        return self._positions

    def record(self, staged: np.ndarray, entries: Iterable[TensorEntry]) -> tuple[list[int], list[int]]:
        """The staged bytes of ``entries`` (a shard, as numpy bytes) against those of save(): the indices compared,
        and those that differ. Numpy only: the copy thread hands no GIL over per tensor."""
        entries = list(entries)
        compared: list[int] = []
        moved: list[int] = []
        for g, (rel, owner, ends), then in zip(self._groups, self._at, self.then):
            ks = [k for k in map(g.pos.get, (e.index for e in entries)) if k is not None]
            if not ks:  # (a buffer smaller than a line holds none of the line groups' tensors)
                continue
            view = np.ndarray((staged.nbytes - g.dtype.itemsize + 1,), g.dtype, buffer=staged, strides=(1,))
            for k0, k1 in _runs_of(ks):
                r0, r1 = int(ends[k0 - 1]) if k0 else 0, int(ends[k1 - 1])
                got = view[rel[r0:r1] + g.offset[owner[r0:r1]]]
                compared += g.index[k0:k1]
                if not _same(got, then[r0:r1]):
                    moved += [g.index[k] for k in _differing(got, then[r0:r1], owner[r0:r1], g.dtype)]
        return compared, sorted(moved, key=self.layout.rank.__getitem__)

    def moved(self) -> list[int]:
        """At the seal: the indices whose bytes now differ from save()'s, or that no longer have comparable bytes
        (moved to memory of another size or layout). The sources still in their memory are read in one gather per
        group; a moved one is read at its new address."""
        assert self.tensors is not None, "moved() after let_go()"
        layout = self.layout
        sources = layout.pick(self.tensors)
        ptrs = list(map(_ptr, sources))
        if ptrs == layout.ptrs and list(map(_nbytes, sources)) == layout.sizes:
            changed: list[int] = []
            where = None
        else:
            changed, where = self._moved_sources(sources, ptrs)
        out = list(changed)
        for g, (rel, owner, _), then, idx in zip(self._groups, self._at, self.then, self._idx):
            if not len(rel):
                continue
            if where is None:
                now, keep = g.memory[idx], None
            else:
                addr = np.array([where.get(i, -1) for i in g.index], dtype=np.int64)
                ok = addr[owner] >= 0
                if not ok.any():
                    continue
                memory, base = _read(addr[addr >= 0], g.nbytes[addr >= 0], g.dtype)
                keep = ok
                now = memory[rel[ok] + (addr - base)[owner[ok]]]
            ref = then if keep is None else then[keep]
            if not _same(now, ref):
                out += [g.index[k] for k in _differing(now, ref, owner if keep is None else owner[keep], g.dtype)]
        return sorted(out, key=self.layout.rank.__getitem__)

    def _moved_sources(self, sources: list[torch.Tensor], ptrs: list[int]) -> tuple[list[int], dict[int, int]]:
        """Where each source is now, if its bytes are still comparable (the same size, plain host bytes), and the
        indices that are not."""
        changed: list[int] = []
        where: dict[int, int] = {}
        for index, src, ptr, size in zip(self.order, sources, ptrs, self.layout.sizes):
            itemsize = self._itemsize(index)
            if src.nbytes == size and src.element_size() == itemsize and plain_host(src):
                where[index] = ptr
            else:
                changed.append(index)
        return changed, where

    def _itemsize(self, index: int) -> int:
        for g in self._groups:
            k = g.pos.get(index)
            if k is not None:
                return g.itemsize[k]
        raise KeyError(index)

    def recorded_all(self, staged: set[int]) -> bool:
        return staged.issuperset(self.order)

    def let_go(self) -> None:
        """The seal is done: the sources are no longer read (the copy thread compares gathered bytes only)."""
        self.tensors = None

    def runs(self) -> dict[int, tuple[int, int, int, int, int]]:
        """Each tensor's sampled bytes as seal.py's ``_Run`` fields (size, start, step, count, per), in elements."""
        out: dict[int, tuple[int, int, int, int, int]] = {}
        for g, (_, _, ends) in zip(self._groups, self._at):
            for k, index in enumerate(g.index):
                size, nbytes = g.itemsize[k], int(g.nbytes[k])
                if g is self.layout.lines:
                    count = int(ends[k] - (ends[k - 1] if k else 0))
                    out[index] = (size, int(self._first[k]) // size, self.layout.stride // size, count, RUN // size)
                else:
                    out[index] = (size, 0, nbytes // size, 1, nbytes // size)
        return out


def _runs_of(ks: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs ``[k0, k1)`` of the sorted positions ``ks`` (a shard's tensors: usually one run)."""
    out: list[tuple[int, int]] = []
    for k in ks:
        if out and out[-1][1] == k:
            out[-1] = (out[-1][0], k + 1)
        else:
            out.append((k, k + 1))
    return out


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bytes equal (NaNs are bytes here), compared as Python bytes: a copy and a memcmp under the GIL, tens of
    microseconds for a shard's samples, where ``torch.equal`` over ``from_numpy`` views handed the GIL over five
    times a call (180 hand-overs of the copy thread a W1 checkpoint, counted by ``benchmarks.gilcalls``)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _differing(a: np.ndarray, b: np.ndarray, owner: np.ndarray, dtype: np.dtype) -> list[int]:
    """The group positions of the tensors whose records differ between ``a`` and ``b``."""
    rows = (a.view(np.uint8).reshape(-1, dtype.itemsize) != b.view(np.uint8).reshape(-1, dtype.itemsize)).any(axis=1)
    return [int(k) for k in np.unique(owner[rows])]
