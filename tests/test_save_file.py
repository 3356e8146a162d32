"""``Checkpointer.save_file``: torch's own file, staged lazily and written by the engine."""
from __future__ import annotations

import os
import zipfile

import pytest
import torch

from fastckpt import CheckpointConfig, Checkpointer, ConfigError, StorageError
from fastckpt.storage.local import LocalStorage
from fastckpt.format.torchfile import verify_torch_file


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(16, 32)).sum().backward()
    opt.step()
    return model, opt


def _lightning_like(model, opt, step: int) -> dict:
    return {"epoch": 0, "global_step": step, "state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
            "hyper_parameters": {"lr": 1e-2, "layers": [32, 64, 8]}, "loops": {"fit_loop": {"batches": step}}}


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone(v) for v in obj]
    return obj


def _equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)
    else:
        assert a == b


def test_lazy_save_file_holds_the_values_of_save_time_and_loads_with_plain_torch(tmp_path) -> None:
    model, opt = _model()
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        state = _lightning_like(model, opt, 7)
        expected = _clone(state)
        handle = ckpt.save_file(state, "epoch=0-step=7.ckpt", step=7)
        # the next step runs at once: the optimizer pre-hook waits for the lazy copy, BN stats change in forward
        model(torch.randn(16, 32)).sum().backward()
        opt.step()
        info = handle.wait()
    path = tmp_path / "epoch=0-step=7.ckpt"
    assert info.path == str(path) and info.nbytes == path.stat().st_size
    _equal(expected, torch.load(path, weights_only=True))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None
    assert verify_torch_file(str(path)) == []
    assert sorted(os.listdir(tmp_path)) == ["epoch=0-step=7.ckpt"]  # no sidecar, no temporary left


def test_repeated_save_file_reuses_the_plan_and_buffers(tmp_path) -> None:
    model, opt = _model()
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        for step in range(1, 5):
            ckpt.save_file(_lightning_like(model, opt, step * 100), f"s{step}.ckpt", step=step).wait()
            model(torch.randn(16, 32)).sum().backward()
            opt.step()
        first = dict(ckpt.counters)
        ckpt.save_file(_lightning_like(model, opt, 123456789), "s5.ckpt", step=5).wait()  # a longer pickle
        assert ckpt.counters == first
    assert torch.load(tmp_path / "s5.ckpt", weights_only=True)["global_step"] == 123456789


class _Failing(LocalStorage):
    def write_file_atomic(self, path, parts):
        self._write_buffered(path + ".partial", parts[:1])  # a torn write that never reaches the name
        raise StorageError(f"writing {path!r} failed: [Errno 28] No space left on device")


def test_a_failed_write_leaves_no_file_under_the_name_and_is_raised_once(tmp_path) -> None:
    model, opt = _model()
    (tmp_path / "good.ckpt").write_bytes(b"previous")
    with Checkpointer(CheckpointConfig(root=str(tmp_path)), storage=_Failing(str(tmp_path))) as ckpt:
        handle = ckpt.save_file(_lightning_like(model, opt, 1), "good.ckpt", step=1)
        with pytest.raises(StorageError, match="No space left"):
            ckpt.wait()
        ckpt.wait()  # raised once
        with pytest.raises(StorageError):
            handle.wait()
    assert (tmp_path / "good.ckpt").read_bytes() == b"previous"


def test_save_file_refuses_shm_and_an_unpicklable_state(tmp_path) -> None:
    cfg = CheckpointConfig(root=str(tmp_path), staging={"shm": True, "shm_dir": str(tmp_path)})
    with Checkpointer(cfg) as ckpt, pytest.raises(ConfigError, match="staging.shm"):
        ckpt.save_file({"w": torch.ones(2)}, "x.ckpt")
    with Checkpointer(CheckpointConfig(root=str(tmp_path / "b"))) as ckpt:
        with pytest.raises(Exception, match="x.ckpt"):
            ckpt.save_file({"f": lambda: 1}, "x.ckpt")
        with pytest.raises(ConfigError):
            ckpt.save_file({"w": torch.ones(2)}, "../escape.ckpt")


def test_save_file_on_memory_fs(tmp_path) -> None:
    import uuid

    root = f"memory://fastckpt-{uuid.uuid4().hex}"
    with Checkpointer(CheckpointConfig(root=root)) as ckpt:
        state = {"w": torch.randn(100, 3), "step": 3}
        ckpt.save_file(state, "a.ckpt", step=3).wait()
        import fsspec

        with fsspec.open(f"{root}/a.ckpt", "rb") as f:
            loaded = torch.load(f, weights_only=True)
    _equal(state, loaded)


def test_a_watched_tensor_changed_before_its_lazy_copy_fails_the_file_by_name(tmp_path, monkeypatch) -> None:
    import threading

    import fastckpt.engine.pipeline as pipeline
    from fastckpt.errors import SnapshotMutatedError

    gate = threading.Event()
    real = pipeline.Pipeline._copy_shard

    def held(self, job, shard, *rest):  # the copy thread waits until the test has written in place
        if threading.current_thread().name.startswith("fastckpt-copy") and not gate.wait(timeout=60):
            raise TimeoutError("test gate never opened")
        return real(self, job, shard, *rest)

    monkeypatch.setattr(pipeline.Pipeline, "_copy_shard", held)
    model, opt = _model()
    (tmp_path / "a.ckpt").write_bytes(b"previous")
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)
        handle = ckpt.save_file(_lightning_like(model, opt, 1), "a.ckpt", step=1)
        with torch.no_grad():
            model[0].weight.clamp_(-0.01, 0.01)  # weight surgery outside optimizer.step(), before the copy
        gate.set()
        with pytest.raises(SnapshotMutatedError, match="state_dict/0.weight"):
            handle.wait()
        ckpt.wait()  # raised once, through the handle
    assert (tmp_path / "a.ckpt").read_bytes() == b"previous"  # the file under the name was never replaced
