"""The compiled kernel of the fused pass (format/fused.py): a whole shard's copy, CRC32C and health reductions in
one call that holds no GIL.

Imported only by format/fused.py's warm-up, never by ``import fastckpt``: importing this module imports numba and
compiles (or loads from numba's on-disk cache) the kernel for its one signature, which holds the GIL of the
importing process for about a third of a second from the cache, seconds when compiling. The warm-up therefore
compiles it first in a child process (filling the cache) and imports it here only once that succeeded.

The kernel walks a shard's entries (each a source pointer, a destination pointer in the staged buffer, a byte
count and a kind) in chunks of ``chunk`` bytes: for each chunk it copies the bytes (where asked), takes the CRC32C
of the *staged* copy (or zip's CRC-32, a torch file's) through the C function of the package that computes it for
fastckpt (its address is an argument, so that the compiled code holds no process-specific constant and can be
cached), and reduces the staged values (the largest magnitude and the sum of squares in float64) while the chunk is
still in cache. Kinds: 0 float32, 1 float64, 2 bfloat16 (widened through a float32 scratch), 3 bytes only
(copied and checksummed; the caller measures them). The largest magnitude is kept as its bits: a NaN or an Inf
anywhere in an entry shows there (bits at or above the exponent's all-ones), and a sum of squares beyond float64
shows as a non-finite sum; either tells the caller to measure that entry value for value instead.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["KINDS", "SIGNATURE", "shard_pass"]

KINDS = {"float32": 0, "float64": 1, "bfloat16": 2, "bytes": 3}

SIGNATURE = types.void(types.int8[::1], types.int64[::1], types.int64[::1], types.int64[::1], types.int64,
                       types.uint32, types.int64, types.boolean, types.uint32[::1], types.uint64[::1],
                       types.float64[::1], types.uint32[::1])


@intrinsic
def _ptr(typingctx, addr):  # type: ignore[no-untyped-def]
    """An integer address as a pointer (carray's argument)."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.int64), codegen


@intrinsic
def _crc(typingctx, fn, value, addr, n):  # type: ignore[no-untyped-def]
    """Call ``uint32_t fn(uint32_t crc, const uint8_t *data, size_t n)`` at address ``fn`` (the crc32c package's
    C function, or zlib-ng's ``zng_crc32``, whose 32-bit length reads the low half of ``n``: a chunk's size)."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(32), cgutils.voidptr_t, ir.IntType(64)])
        target = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(target, [args[1], builder.inttoptr(args[2], cgutils.voidptr_t), args[3]])
    return types.uint32(types.int64, types.uint32, types.int64, types.int64), codegen


@intrinsic
def _memcpy(typingctx, dst, src, n):  # type: ignore[no-untyped-def]
    """``memcpy(dst, src, n)`` between integer addresses: LLVM's intrinsic, which a variable length lowers to the C
    library's ``memcpy``. Numba's slice assignment between two arrays checks whether they overlap and copies through
    a temporary: with it the kernel took 0.63 CPU-s per GB on a 2-core Xeon, with this 0.26 (one ``torch`` copy of
    the same bytes: 0.17)."""
    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        d, s, k = args
        cgutils.raw_memcpy(builder, builder.inttoptr(d, cgutils.voidptr_t), builder.inttoptr(s, cgutils.voidptr_t),
                           k, 1)
        return context.get_dummy_value()
    return types.none(types.int64, types.int64, types.int64), codegen


@njit(fastmath=True, nogil=True, inline="always")
def _reduce32(bits, values):  # type: ignore[no-untyped-def]
    """The largest magnitude's bits and the float64 sum of squares of float32 ``values`` (``bits``: the same
    memory as uint32). Magnitudes are compared as integers: for non-negative floats the two orders agree, an
    integer max vectorizes where a float one with NaN rules does not, and a NaN or an Inf shows as bits at or above
    the exponent's all-ones."""
    top = np.uint32(0)
    sq = 0.0
    for j in range(values.size):
        m = bits[j] & np.uint32(0x7FFFFFFF)
        top = m if m > top else top
        x = np.float64(values[j])
        sq += x * x
    return np.uint64(top), sq


@njit(fastmath=True, nogil=True, inline="always")
def _reduce64(bits, values):  # type: ignore[no-untyped-def]
    top = np.uint64(0)
    sq = 0.0
    for j in range(values.size):
        m = bits[j] & np.uint64(0x7FFFFFFFFFFFFFFF)
        top = m if m > top else top
        x = values[j]
        sq += x * x
    return top, sq


@njit(SIGNATURE, fastmath=True, nogil=True, cache=True)
def shard_pass(kinds, srcs, dsts, ns, crcfn, flip, chunk, copy, crcs, tops, sqs,  # type: ignore[no-untyped-def]
               scratch):
    """For each entry ``i``: copy ``ns[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` (with ``copy``), and set
    ``crcs[i]`` to the checksum of the bytes at ``dsts[i]`` (``crcfn`` continues a running value; ``flip`` is
    xor-ed into it before the first call and after the last: 0xFFFFFFFF for the crc32c package's function, whose
    running value is the inverted register, 0 for zlib's ``crc32``) and, for a float kind, ``tops[i]`` to the bits
    of their largest magnitude (in the kind's own width) and ``sqs[i]`` to their float64 sum of squares (``scratch``: at
    least ``chunk // 2`` slots, bfloat16's widening)."""
    wide = scratch.view(np.float32)
    for i in range(kinds.size):
        kind = kinds[i]
        n = ns[i]
        crc = flip
        top = np.uint64(0)
        sq = 0.0
        at = 0
        while at < n:
            k = min(chunk, n - at)
            dst = dsts[i] + at
            if copy:
                _memcpy(dst, srcs[i] + at, k)
            crc = _crc(crcfn, crc, dst, k)
            t = np.uint64(0)
            c = 0.0
            if kind == 0:
                t, c = _reduce32(carray(_ptr(dst), k // 4, np.uint32), carray(_ptr(dst), k // 4, np.float32))
            elif kind == 1:
                t, c = _reduce64(carray(_ptr(dst), k // 8, np.uint64), carray(_ptr(dst), k // 8, np.float64))
            elif kind == 2:  # bfloat16: the high half of a float32
                half = carray(_ptr(dst), k // 2, np.uint16)
                m = half.size
                for j in range(m):
                    scratch[j] = np.uint32(half[j]) << np.uint32(16)
                t, c = _reduce32(scratch[:m], wide[:m])
                t = t >> np.uint64(16)
            top = t if t > top else top
            sq += c
            at += k
        crcs[i] = crc ^ flip
        tops[i] = top
        sqs[i] = sq
