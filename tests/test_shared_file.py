"""One torch file written by every data-parallel rank (``save_file`` with ``distributed=True``), on gloo ranks."""
from __future__ import annotations

import errno
import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, ConfigError, StorageError
from fastckpt.format.health import HEALTH_ATTR, file_health
from fastckpt.storage.protocol import open_storage
from tests.dist_launcher import run_ranks, same_replicas
from tests.helpers import WrappedStorage, assert_bit_equal, clone_state

pytestmark = pytest.mark.slow


def _replica(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Identical parameters and AdamW state on every rank (as DDP keeps them), BatchNorm statistics of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    same_replicas(model, opt)
    with torch.no_grad():  # a forward on this rank's own batch: BatchNorm's running stats now differ per rank
        model(torch.randn(16, 32, generator=torch.Generator().manual_seed(100 + rank)) * (rank + 1))
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> dict:
    # The pickled bytes differ per rank (a rank's own note, of its own length): every record's offset differs too.
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": step,
            "note": "r" * (997 * rank)}


class FullDisk(WrappedStorage):
    """Fails this rank's ranged writes into files whose path holds ``fail``, as a full disk does."""

    def __init__(self, inner, fail: str) -> None:
        super().__init__(inner)
        self.fail = fail

    def write_at(self, path, pieces):
        if self.fail in path:
            raise OSError(errno.ENOSPC, "injected: ENOSPC", path)
        self.inner.write_at(path, pieces)


def _share(rank: int, world: int, root: str, out: str, mode: str) -> None:
    model, opt = _replica(rank)
    cfg = CheckpointConfig(root=root, staging={"mode": mode}, persist={"chunk_bytes": 8 * 1024})
    with Checkpointer(cfg, distributed=True) as ckpt:
        ckpt.watch(opt)
        state = _state(model, opt, rank, 7)
        ref = clone_state(state)
        handle = ckpt.save_file(state, "epoch=0-step=7.ckpt", step=7)
        ckpt.wait_staged()
        with torch.no_grad():  # the snapshot was taken: changing everything now must not reach the file
            for p in model.parameters():
                p.add_(1.0)
            model(torch.randn(4, 32))
        handle.wait()
        written = [None] * world
        dist.all_gather_object(written, handle.stats.written_bytes)
        torch.save({"ref": ref, "written": written, "nbytes": handle.stats.nbytes}, Path(out) / f"rank{rank}.pt")


@pytest.mark.parametrize("world,mode", [(2, "lazy"), (4, "lazy"), (2, "eager")])
def test_every_rank_writes_its_part_of_one_genuine_torch_file(tmp_path, world, mode):
    root = tmp_path / "ckpt"
    run_ranks(_share, world, str(root), str(tmp_path), mode)
    path = root / "epoch=0-step=7.ckpt"
    assert sorted(p.name for p in root.iterdir()) == [".fastckpt.lock", path.name], "no temporary file left"
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None, "every record's CRC-32 is filled in and right"
    loaded = torch.load(path, weights_only=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    # The test's premise, checked first so that a failure says which side broke: the tensors every rank may write
    # (parameters, optimizer state) are the same bits on every rank, as DDP keeps them. A difference here is the
    # replicas' arithmetic; a difference below only is a snapshot that is not the values at save().
    for r in range(1, world):
        mine, first = ranks[r]["ref"], ranks[0]["ref"]
        spread = [k for k in mine["state_dict"] if "running_" not in k and "num_batches" not in k]
        assert_bit_equal([mine["state_dict"][k] for k in spread], [first["state_dict"][k] for k in spread],
                         f"rank {r}'s replica {spread}")
        assert_bit_equal(mine["optimizer_states"], first["optimizer_states"], f"rank {r}'s replica")
    assert_bit_equal(loaded, ranks[0]["ref"])  # rank 0's pickle, the parameters from whoever wrote them
    written = ranks[0]["written"]
    assert all(w > 0 for w in written), f"every rank wrote part of the file: {written}"
    assert sum(written) == path.stat().st_size == ranks[0]["nbytes"], "the parts add up to the file, no overlap"
    # Its health record, from every rank's statistics, is the file's extended attribute (set by rank 0 before the
    # rename): every record measured, nothing beside the file.
    record = json.loads(os.getxattr(path, HEALTH_ATTR))
    with zipfile.ZipFile(path) as z:
        tensors = sum(1 for n in z.namelist() if "/data/" in n and not n.endswith("serialization_id"))
    assert record["step"] == 7 and record["size"] == path.stat().st_size
    assert record["health"]["healthy"] is True and record["health"]["complete"] is True
    assert record["health"]["count"] == tensors
    # ...tied to the bytes rank 0 published (the records' CRC-32s, from every rank): believed as the file's own
    assert file_health(open_storage(str(path.parent)), str(path))["healthy"] is True
    # The buffers are rank 0's: rank 1's differ, so had rank 1 written them the comparison above would fail.
    for buffer in ("1.running_mean", "1.running_var"):
        assert not torch.equal(loaded["state_dict"][buffer], ranks[1]["ref"]["state_dict"][buffer]), buffer


def _fail(rank: int, world: int, root: str, what: str) -> None:
    model, opt = _replica(rank)
    storage = open_storage(root)
    if rank == 1:
        storage = FullDisk(storage, fail="step=2")
    with Checkpointer(CheckpointConfig(root=root), storage=storage, distributed=True) as ckpt:
        ckpt.watch(opt)
        ckpt.save_file(_state(model, opt, rank, 1), "epoch=0-step=1.ckpt", step=1).wait()
        if what == "mismatch":
            state = _state(model, opt, rank, 2)
            if rank == 1:
                state["extra"] = torch.zeros(3)  # a structure rank 0 does not have
            name = "epoch=0-step=3.ckpt"
        else:
            state, name = _state(model, opt, rank, 2), "epoch=0-step=2.ckpt"
        ckpt.save_file(state, name, step=2)
        with pytest.raises(StorageError) as raised:
            ckpt.wait()
        text = str(raised.value)
        assert name in text and "rank 1" in text, text
        assert ("injected: ENOSPC" if what == "write" else "differ from rank 0's") in text, text
        ckpt.wait()  # raised once
        ckpt.save_file(_state(model, opt, rank, 4), "epoch=0-step=4.ckpt", step=4).wait()  # the next one works


@pytest.mark.parametrize("what", ["write", "mismatch"])
def test_a_failure_on_one_rank_fails_the_file_on_every_rank(tmp_path, what):
    root = tmp_path / "ckpt"
    run_ranks(_fail, 2, str(root), what)
    assert sorted(p.name for p in root.iterdir()) == [".fastckpt.lock", "epoch=0-step=1.ckpt", "epoch=0-step=4.ckpt"]
    for name in ("epoch=0-step=1.ckpt", "epoch=0-step=4.ckpt"):
        assert torch.load(root / name, weights_only=True)["global_step"] == int(name[-6])


def _object_store(rank: int, world: int) -> None:
    with Checkpointer(CheckpointConfig(root="memory://shared"), distributed=True) as ckpt:
        with pytest.raises(ConfigError, match="object store"):
            ckpt.save_file({"w": torch.ones(2)}, "a.ckpt")


def test_an_object_store_is_refused_for_a_shared_file():
    run_ranks(_object_store, 2)
