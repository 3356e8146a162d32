"""Boundary checks in save(): every value either round-trips bit-exactly or is refused inside save(), by name.

A value the background writer cannot encode must never get past save(): the save would fail
later, after the caller moved on, and a refused save must leave nothing behind.
"""
from __future__ import annotations

import collections
import os
import warnings

import numpy as np
import pytest
import torch

from fastckpt import Checkpointer, CheckpointConfig, StateMismatchError, UnsafeCheckpointError
from fastckpt.format.codec import MAX_NESTING
from tests.helpers import assert_bit_equal, clone_state, listed


@pytest.fixture
def ckpt(tmp_path):
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as c:
        yield c


def _roundtrip(ckpt: Checkpointer, state: dict, step: int = 0) -> dict:
    ref = clone_state(state)
    ckpt.save(state, step=step).wait()
    out = ckpt.load(step)
    assert_bit_equal(ref, out)
    return out


def _assert_refused(ckpt: Checkpointer, tmp_path, state: dict, exc: type, *needles: str) -> None:
    """save() itself raises, naming the value; nothing is written; the previous checkpoint stays good."""
    good = {"w": torch.arange(6.0)}
    ckpt.save(good, step=1).wait()
    with pytest.raises(exc) as info:
        ckpt.save(state, step=2)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    ckpt.wait()  # no background error is left for later either
    assert [i.step for i in ckpt.list()] == [1]
    assert listed(tmp_path) == ["step-000000001"]
    assert_bit_equal(good, ckpt.load(1))


# ---- numpy scalars and Python ints: round-trip exactly (they used to fail in the background) ----

_NUMPY_SCALARS = {
    "complex64": np.complex64(1.5 - 2.25j),
    "complex128": np.complex128(np.pi + 1e-300j),
    "datetime64_day": np.datetime64("2020-02-29"),
    "datetime64_ns": np.datetime64("2024-05-01T12:34:56.123456789"),
    "datetime64_nat": np.datetime64("NaT"),
    "timedelta64": np.timedelta64(-5, "ms"),
    "bytes_": np.bytes_(b"a\x00b\xff"),
    "str_": np.str_("héllo"),
    "void": np.void(b"\x01\x02\x03"),
    "longdouble": np.longdouble(1) / np.longdouble(3),  # more precision than a float
    "float16": np.float16(-0.0),
    "float32_nan": np.float32("nan"),
    "uint64_max": np.uint64(2**64 - 1),
    "int8": np.int8(-128),
    "bool_": np.bool_(True),
}


@pytest.mark.parametrize("name", list(_NUMPY_SCALARS))
def test_numpy_scalar_roundtrips_exactly(ckpt, name: str) -> None:
    value = _NUMPY_SCALARS[name]
    out = ckpt.save({"s": value}, step=0)
    out.wait()
    back = ckpt.load(0)["s"]
    assert type(back) is type(value) and back.dtype == value.dtype
    assert back.tobytes() == value.tobytes()


def test_structured_numpy_scalar_is_refused_by_name(ckpt, tmp_path) -> None:
    rec = np.zeros(1, dtype=[("a", "<i4"), ("b", "<f8")])[0]
    _assert_refused(ckpt, tmp_path, {"meta": {"rec": rec}}, StateMismatchError, "'meta/rec'", "structured")


@pytest.mark.parametrize("value", [10**5000, -(10**5000) + 7, 2**64, -(2**63) - 1, 2**64 - 1, -(2**63)],
                         ids=["5000_digits", "neg_5000_digits", "2^64", "below_int64", "uint64_max", "int64_min"])
def test_python_int_of_any_size_roundtrips(ckpt, value: int) -> None:
    ckpt.save({"n": value, "as_key": {value: "v"}, "in_list": [value]}, step=0).wait()
    out = ckpt.load(0)
    # compared as ints, never printed: str() of 5000 digits raises
    assert type(out["n"]) is int and out["n"] == value and out["in_list"][0] == value
    assert list(out["as_key"]) == [value] and out["as_key"][value] == "v"


# ---- containers -----------------------------------------------------------------------------

def test_self_referencing_list_is_refused_by_name(ckpt, tmp_path) -> None:
    loop: list = [1, 2]
    loop.append(loop)
    _assert_refused(ckpt, tmp_path, {"cfg": {"loop": loop}}, StateMismatchError, "'cfg/loop/2'", "cycle")


def test_self_referencing_dict_is_refused_by_name(ckpt, tmp_path) -> None:
    a: dict = {"x": torch.ones(2)}
    a["self"] = {"back": a}
    _assert_refused(ckpt, tmp_path, {"a": a}, StateMismatchError, "'a/self/back'", "cycle")


def _nest(depth: int, leaf: object) -> object:
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"k": leaf}
    return leaf


def test_too_deep_nesting_is_a_named_error(ckpt, tmp_path) -> None:
    """Deeper than loading accepts (and, at 100000, than Python's recursion limit): refused by path, not RecursionError."""
    for depth in (MAX_NESTING + 1, 100_000):
        _assert_refused(ckpt, tmp_path, {"deep": _nest(depth - 1, 1.0)}, StateMismatchError,
                        "'deep/", f"nested more than {MAX_NESTING} deep")


def test_nesting_up_to_the_limit_roundtrips(ckpt) -> None:
    _roundtrip(ckpt, {"deep": _nest(MAX_NESTING - 1, torch.arange(3))})


def test_shared_but_acyclic_containers_are_fine(ckpt) -> None:
    shared = {"lr": 0.1, "betas": (0.9, 0.999)}
    _roundtrip(ckpt, {"g0": shared, "g1": shared, "pair": [shared, shared], "size": torch.Size([2, 3])})


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("value,word", [(Point(1, 2), "would refuse"), (lambda: 0, "cannot be serialized")],
                         ids=["not_allowlisted", "unpicklable"])
def test_object_leaf_is_refused_by_key_path(ckpt, tmp_path, value, word: str) -> None:
    _assert_refused(ckpt, tmp_path, {"loops": {"fit": value}, "ok": 1.0}, UnsafeCheckpointError, "'loops/fit'", word)


# ---- tensors: round-trip bit-exactly or refused by name -------------------------------------

def _float8_dtypes() -> list[torch.dtype]:
    names = ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _exotic_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    bf16 = torch.randn(8, generator=g).bfloat16()
    bf16.view(torch.int16)[0] = 0x7FC1  # a NaN with a payload: compared as bits
    tensors = {
        "requires_grad": torch.randn(3, 3, generator=g, requires_grad=True),
        "transposed": base.t(),
        "strided_slice": base[::2, 1::3],
        "expanded": torch.randn(1, 5, generator=g).expand(4, 5),
        "storage_offset": base.view(-1)[5:17],
        "complex64": torch.randn(5, dtype=torch.complex64, generator=g),
        "complex128": torch.randn(2, 3, dtype=torch.complex128, generator=g),
        "complex_conj_view": torch.randn(5, dtype=torch.complex64, generator=g).conj(),
        "neg_view": torch._neg_view(torch.randn(5, dtype=torch.complex64, generator=g)),
        "bool": torch.rand(7, generator=g) > 0.5,
        "bfloat16_nan_payload": bf16,
        "uint16": torch.tensor([0, 1, 65535], dtype=torch.uint16),
        "uint64": torch.tensor([0, 2**63], dtype=torch.uint64),
        "zero_size": torch.empty(0, 3),
        "zero_size_int": torch.empty(5, 0, dtype=torch.int64),
        "zero_dim": torch.tensor(3.25),
        "zero_dim_int": torch.tensor(-7, dtype=torch.int8),
        "zero_dim_bool": torch.tensor(True),
    }
    for dtype in _float8_dtypes():
        tensors[str(dtype).removeprefix("torch.")] = torch.randn(9, generator=g).clamp(-2, 2).to(dtype)
    return tensors


_TENSORS = _exotic_tensors()


@pytest.mark.parametrize("name", list(_TENSORS))
def test_tensor_roundtrips_bit_exactly(ckpt, name: str) -> None:
    t = _TENSORS[name]
    ckpt.save({"t": t, "also_0d": torch.tensor(1.0)}, step=0).wait()
    back = ckpt.load(0)["t"]
    assert back.dtype == t.dtype and back.shape == t.shape and back.layout == torch.strided
    assert torch.equal(_bits(back), _bits(t))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bytes (conj/neg views resolved): NaN payloads and -0.0 compare exactly."""
    return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)


def test_tensors_roundtrip_through_lazy_copies(tmp_path) -> None:
    """The lazy copy path (watched params and optimizer state) is exact for complex and low-precision dtypes."""
    params = [torch.nn.Parameter(torch.randn(6, dtype=dt)) for dt in (torch.complex64, torch.bfloat16, torch.float16)]
    opt = torch.optim.SGD(params, lr=0.1)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        state = {"p": [p.detach() for p in params]}
        plan_before = ckpt._planner.plans_built
        out = _roundtrip(ckpt, state)
        assert ckpt._planner.plans_built == plan_before + 1
        assert all(e.lazy for e in next(iter(ckpt._planner._cache.values())).entries)
        assert all(torch.equal(a, b) for a, b in zip(out["p"], state["p"]))


def _quantized() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized dtypes are deprecated in torch 2.13
        return {
            "qint8": torch.quantize_per_tensor(torch.randn(8), 0.1, 3, torch.qint8),
            "quint8_per_channel": torch.quantize_per_channel(torch.randn(2, 4), torch.tensor([0.1, 0.2]),
                                                            torch.tensor([0, 1]), 0, torch.quint8),
        }


def _nested() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the strided nested layout is a prototype
        return {
            "nested_strided": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
            "nested_jagged": torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged),
        }


def _sparse() -> dict[str, tuple[torch.Tensor, str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CSR layout is beta
        return {"sparse_coo": (torch.eye(3).to_sparse(), "sparse_coo"),
                "sparse_csr": (torch.eye(3).to_sparse_csr(), "sparse_csr")}


_REFUSED = {
    **_quantized(),
    **_nested(),
    **_sparse(),
    "meta": (torch.empty(4, device="meta"), "meta tensor"),
}


@pytest.mark.parametrize("name", list(_REFUSED))
def test_unstorable_tensor_is_refused_by_name(ckpt, tmp_path, name: str) -> None:
    entry = _REFUSED[name]
    t, word = entry if isinstance(entry, tuple) else (entry, "quantized" if entry.is_quantized else "nested")
    _assert_refused(ckpt, tmp_path, {"model": {"layer.weight": t}}, StateMismatchError, "'model/layer.weight'", word)


class _NoStorage(torch.Tensor):
    """A wrapper subclass (like torchao's or FSDP's): it has a shape and a dtype but no storage of its own."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not supported by _NoStorage")


def test_tensor_subclass_without_storage_is_refused_by_name(ckpt, tmp_path) -> None:
    _assert_refused(ckpt, tmp_path, {"model": {"w": _NoStorage((3, 4))}}, StateMismatchError, "'model/w'",
                    "_NoStorage", "no readable data")


# ---- numpy arrays ---------------------------------------------------------------------------

def test_numpy_array_with_negative_strides_roundtrips(ckpt) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[::-1, ::-2]
    ckpt.save({"a": a}, step=0).wait()
    back = ckpt.load(0)["a"]
    assert isinstance(back, np.ndarray) and back.dtype == a.dtype and np.array_equal(back, a)


@pytest.mark.parametrize("array,word", [
    (np.array(["2020-01-01"], dtype="datetime64[D]"), "datetime64"),
    (np.array(["ab", "c"]), "<U2"),
    (np.arange(3, dtype=">f4"), "byte order"),
    (np.zeros(2, dtype=np.longdouble), "float128"),
], ids=["datetime64", "unicode", "big_endian", "longdouble"])
def test_numpy_array_without_torch_dtype_is_refused_by_name(ckpt, tmp_path, array, word: str) -> None:
    _assert_refused(ckpt, tmp_path, {"data": {"arr": array}}, StateMismatchError, "'data/arr'", word)
