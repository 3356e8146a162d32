"""Round trips through every backend, compared bit for bit."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

from fastckpt import Checkpointer, CheckpointConfig
from tests.backends import Backend, backend  # noqa: F401  (fixture)
from tests.helpers import assert_bit_equal, clone_state

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                       "float8_e8m0fnu") if hasattr(torch, n)]


def _random(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape) if raw.numel() else torch.empty(shape, dtype=dtype)


def _zoo() -> dict:
    g = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
              torch.int8, torch.uint8, torch.bool, torch.complex64, *FLOAT8]
    zoo = {str(d).removeprefix("torch."): _random(d, (3, 5), g) for d in dtypes if d is not torch.bool}
    zoo["bool"] = torch.rand(3, 5, generator=g) > 0.5
    shared = torch.randn(4, 4, generator=g)
    zoo["specials"] = {
        "scalar": torch.tensor(3.25),
        "int_scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "noncontig": torch.randn(6, 8, generator=g).t()[::2],
        "nan_inf": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
        "tied_a": shared,
        "tied_b": shared,
    }
    zoo["nested"] = OrderedDict(
        plain=[1, 2.5, "x", None, True, b"\x00\xff", (1, (2, 3)), float("nan"), float("-inf")],
        int_keys={0: torch.ones(2), 1: {"lr": 1e-3, "betas": (0.9, 0.999)}},
        np_array=np.arange(6, dtype=np.uint32).reshape(2, 3),
        np_scalar=np.float32(1.5),
        dtype=torch.bfloat16,
        size=torch.Size([2, 3]),
        empty=[],
    )
    return zoo


def test_round_trip_bit_exact(backend: Backend) -> None:
    state = _zoo()
    ref = clone_state(state)
    with Checkpointer(backend.config(persist={"chunk_bytes": 4096})) as ckpt:
        h = ckpt.save(state, step=3)
        info = h.wait()
        assert info.step == 3 and ckpt.latest() == 3
        loaded = ckpt.load()
    assert_bit_equal(ref, loaded)
    # tied tensors come back tied: one entry, one tensor
    assert loaded["specials"]["tied_a"] is loaded["specials"]["tied_b"]


def test_load_into_reuses_target_tensors(backend: Backend) -> None:
    src = {"w": torch.randn(16, 16), "b": torch.randn(16), "meta": {"epoch": 2}}
    target = {"w": torch.zeros(16, 16), "b": torch.zeros(16), "meta": {"epoch": 0}}
    w_ptr = target["w"].data_ptr()
    with Checkpointer(backend.config()) as ckpt:
        ckpt.save(src, step=1).wait()
        out = ckpt.load_into(target)
    assert out["w"].data_ptr() == w_ptr
    assert_bit_equal(src, out)
    assert torch.equal(target["w"], src["w"])


def test_latest_and_load_by_step_and_name(backend: Backend) -> None:
    with Checkpointer(backend.config()) as ckpt:
        assert ckpt.latest() is None
        for step in (1, 5, 3):
            ckpt.save({"x": torch.full((2,), float(step))}, step=step)
        ckpt.wait()
        assert ckpt.latest() == 5
        assert [i.step for i in ckpt.list()] == [1, 3, 5]
        assert ckpt.load(step=3)["x"][0].item() == 3.0
        assert ckpt.load(name="step-000000001")["x"][0].item() == 1.0
        assert ckpt.load()["x"][0].item() == 5.0


def test_resave_same_name_replaces_atomically(backend: Backend) -> None:
    with Checkpointer(backend.config()) as ckpt:
        ckpt.save({"x": torch.zeros(3)}, step=1, name="last").wait()
        ckpt.save({"x": torch.ones(3)}, step=2, name="last").wait()
        assert torch.equal(ckpt.load(name="last")["x"], torch.ones(3))
        files = ckpt.storage.listdir(ckpt.storage.join(ckpt.storage.url, "last"))
    # the replaced save's files are gone: one shard, one meta, one manifest
    assert sorted(f.split(".")[0] for f in files) == ["manifest", "meta", "shard-00000"], files


def test_plain_safetensors_reads_the_shards(tmp_path) -> None:
    from safetensors import safe_open

    state = {"w": torch.randn(8, 8), "h": torch.randn(4).half(), "f8": torch.randn(4).to(torch.float8_e4m3fn)}
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(state, step=0).wait()
    d = tmp_path / "step-000000000"
    seen = {}
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                seen[k] = sf.get_tensor(k)
    assert set(seen) == {"w", "h", "f8"}
    for k in state:
        assert_bit_equal(state[k], seen[k], k)


def test_map_location_and_module_level_loader(tmp_path) -> None:
    import fastckpt

    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save({"w": torch.arange(4.0)}, step=9).wait()
    path = str(tmp_path / "step-000000009")
    assert fastckpt.is_checkpoint(path)
    assert not fastckpt.is_checkpoint(str(tmp_path / "nope"))
    out = fastckpt.load_checkpoint(path, map_location="cpu")
    assert torch.equal(out["w"], torch.arange(4.0))
    out2 = fastckpt.load_checkpoint(path + "/manifest.json", map_location=torch.float64 and (lambda t, _: t.double()))
    assert out2["w"].dtype == torch.float64


def test_loaded_rng_state_is_usable(tmp_path) -> None:
    """Small tensors own their storage: RNG setters ignore storage offsets."""
    g = torch.Generator().manual_seed(123)
    state = {"big": torch.randn(512, 1024), "cpu_rng": torch.get_rng_state(), "gen": g.get_state()}
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(state, step=0).wait()
        loaded = ckpt.load()
    assert loaded["cpu_rng"].storage_offset() == 0 and loaded["gen"].storage_offset() == 0
    torch.set_rng_state(loaded["cpu_rng"])
    g2 = torch.Generator()
    g2.set_state(loaded["gen"])
    assert torch.equal(torch.randn(4, generator=g2), torch.randn(4, generator=g))


@pytest.mark.parametrize("direct_io", ["on", "off", "auto"])
def test_local_write_modes_round_trip(tmp_path, direct_io: str) -> None:
    """O_DIRECT writes the aligned prefix and appends the unaligned tail; every mode reads back exactly."""
    import os

    from fastckpt.storage.protocol import open_storage

    probe = open_storage(str(tmp_path), direct_io="auto")
    probe.write_file(str(tmp_path / "probe"), [memoryview(bytearray(4096))])
    if direct_io == "on" and probe._direct_works is False:
        pytest.skip(f"{tmp_path} is on a filesystem without O_DIRECT (tmpfs?)")
    state = {"odd": torch.randn(1000, 333), "tiny": torch.arange(3, dtype=torch.int8)}
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "c"), persist={"direct_io": direct_io})) as ckpt:
        ckpt.save(state, step=1).wait()
        assert_bit_equal(state, ckpt.load())
    shard = next((tmp_path / "c" / "step-000000001").glob("shard-*"))
    assert os.path.getsize(shard) % 4096 != 0  # the tail really was unaligned


def test_views_whose_memory_is_not_their_values(backend: Backend) -> None:
    """Contiguous host tensors are staged as raw bytes; conj/neg views (lazy bits over untouched memory) and
    strided views must still be saved as the values they show."""
    z = torch.randn(5, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    state = {"conj": z.conj(), "neg": z.conj().imag, "strided": torch.arange(12.0).view(3, 4).t(), "plain": z}
    assert state["conj"].is_conj() and state["neg"].is_neg() and not state["strided"].is_contiguous()
    ref = {k: v.resolve_conj().resolve_neg().contiguous().clone() for k, v in state.items()}
    with Checkpointer(backend.config()) as ckpt:
        ckpt.save(state, step=1).wait()
        loaded = ckpt.load()
    assert_bit_equal(ref, {k: v.resolve_conj().resolve_neg() for k, v in loaded.items()})
