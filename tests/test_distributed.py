"""Data-parallel ranks share the writes and read each file once (2 gloo ranks)."""
from __future__ import annotations

import json

from pathlib import Path

import pytest
import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, StateMismatchError, StorageError
from fastckpt.storage.protocol import open_storage
from tests.dist_launcher import run_ranks, same_replicas
from tests.helpers import FaultyStorage, WrappedStorage, assert_bit_equal, clone_state

pytestmark = pytest.mark.slow


class CountingStorage(WrappedStorage):
    def __init__(self, inner):
        super().__init__(inner)
        self.written: list[str] = []
        self.read: list[str] = []

    def write_file(self, path, parts):
        self.written.append(path.rsplit("/", 1)[-1])
        self.inner.write_file(path, parts)

    def read_into(self, path, offset, out):
        self.read.append(path.rsplit("/", 1)[-1])
        self.inner.read_into(path, offset, out)

    def map_file(self, path, size):  # local loads map files instead of reading them
        self.read.append(path.rsplit("/", 1)[-1])
        return self.inner.map_file(path, size)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # identical replicas on every rank, as DDP keeps them
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 64))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _shared_writes(rank: int, world: int, root: str, out: str) -> None:
    model, opt = _model()
    storage = CountingStorage(open_storage(root))
    cfg = CheckpointConfig(root=root, persist={"chunk_bytes": 16 * 1024})
    with Checkpointer(cfg, storage=storage, distributed=True) as ckpt:
        ckpt.watch(opt)
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
        for step in range(3):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            same_replicas(model, opt)  # the premise of the shared writes: every rank holds the same bits
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            ref = clone_state(state)
            h = ckpt.save(state, step=step)
        model(x * 3)  # mutate BN stats and (below) params right after the last save
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        h.wait()
        shards = [n for n in storage.written if n.startswith("shard-") and f".{h.path}" not in n]
        assert ckpt.latest() == 2
        storage.read.clear()
        loaded = ckpt.load()  # collective: every rank gets everything
        assert_bit_equal(ref, loaded)
        mine = [n for n in storage.read if n.startswith("shard-")]
        total = len([n for n in Path(root, "step-000000002").iterdir() if n.name.startswith("shard-")])
        Path(out, f"rank{rank}").write_text(f"{len(shards)} {len(mine)} {total}")
        loaded_into = ckpt.load_into({"model": model.state_dict()})
        assert_bit_equal(ref["model"], loaded_into["model"])
        assert_bit_equal(ref["model"], model.state_dict())


def test_ranks_share_writes_and_reads(tmp_path) -> None:
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run_ranks(_shared_writes, 2, str(root), str(out))
    counts = [list(map(int, (out / f"rank{r}").read_text().split())) for r in range(2)]
    total = counts[0][2]
    assert total >= 4
    assert counts[0][0] > 0 and counts[1][0] > 0, "both ranks must write shards"
    assert counts[0][0] + counts[1][0] == 3 * total, "each shard written by exactly one rank"
    assert counts[0][1] + counts[1][1] == total and counts[0][1] and counts[1][1], "each file read once"
    # a single process (any world size) reads the result
    _, opt = _model()
    with Checkpointer(CheckpointConfig(root=str(root))) as ckpt:
        assert ckpt.load()["step"] == 2
        assert ckpt.latest(healthy=True) == 2  # every rank's tensor statistics reached rank 0's manifest
    folder = root / "step-000000002"
    manifest = json.loads((folder / "manifest.json").read_text())
    keys = {t["key"] for t in json.loads((folder / manifest["meta"]).read_text())["tensors"]}
    assert manifest["health"]["complete"] and set(manifest["health"]["tensors"]) == keys, "every rank's shards measured"


def _one_rank_fails(rank: int, world: int, root: str) -> None:
    inner = open_storage(root)
    storage = FaultyStorage(inner, fail_on=10**9)
    with Checkpointer(CheckpointConfig(root=root, persist={"chunk_bytes": 4096}), storage=storage,
                      distributed=True) as ckpt:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(8)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt.watch(opt)  # watched tensors are spread over both ranks
        state = clone_state(model.state_dict())
        ckpt.save(model.state_dict(), step=1).wait()
        if rank == 1:
            storage.writes, storage.fail_on = 0, 1  # only rank 1's disk fills up
        with torch.no_grad():
            model[0].weight.add_(1)
        h = ckpt.save(model.state_dict(), step=2)
        with pytest.raises(StorageError, match="ENOSPC") as ei:
            h.wait()
        if rank == 0:  # rank 0 learns whose disk failed
            assert "rank 1" in str(ei.value)
        assert ckpt.latest() == 1
        assert_bit_equal(state, ckpt.load())
        with pytest.raises(StateMismatchError, match="different structures"):
            ckpt.save({"only": torch.zeros(rank + 1)}, step=3)


def test_one_rank_failing_fails_the_checkpoint_everywhere(tmp_path) -> None:
    run_ranks(_one_rank_fails, 2, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "step-000000002" / "manifest.json").exists()


def _eager_from_rank0(rank: int, world: int, root: str) -> None:
    model, opt = _model()
    with Checkpointer(CheckpointConfig(root=root, persist={"chunk_bytes": 4096}), distributed=True) as ckpt:
        ckpt.watch(opt)
        model(torch.randn(8, 64) + rank)  # BatchNorm stats now differ per rank, as under DDP
        state = {"model": model.state_dict()}
        ref = clone_state(state)
        ckpt.save(state, step=1).wait()
        saved = ckpt.load()
        truth = [None]
        if rank == 0:
            truth = [ref]
        torch.distributed.broadcast_object_list(truth, src=0)
        assert_bit_equal(truth[0], saved)  # rank 0's buffers, on every rank


def test_eager_tensors_come_from_rank_zero(tmp_path) -> None:
    run_ranks(_eager_from_rank0, 2, str(tmp_path / "ckpt"))


def _gloo_worker_threads() -> int:
    """Threads gloo starts per process group (two by default), named by torch."""
    tasks = Path("/proc/self/task")
    return sum((t / "comm").read_text().strip() == "pt_gloo_runloop" for t in tasks.iterdir())


def _close_joins_private_group(rank: int, world: int, root: str) -> None:
    import weakref

    from torch.distributed.distributed_c10d import _world

    ckpt = Checkpointer(CheckpointConfig(root=root), distributed=True)
    private = weakref.ref(ckpt._coord.group)
    gloo = weakref.ref(ckpt._coord.group._get_backend(torch.device("cpu")))
    assert private() in _world.pg_map  # its own group, with its own worker threads
    ckpt.save({"w": torch.arange(10.0)}, step=0).wait()
    threads = _gloo_worker_threads()
    ckpt.close()
    # Destroyed and joined at close(): no thread is left to drop a finished work (Python objects) while the
    # interpreter finalizes, which aborts the process (pytorch#190489).
    assert private() is None and gloo() is None
    assert _gloo_worker_threads() < threads


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_close_destroys_the_private_group_and_joins_its_threads(tmp_path) -> None:
    run_ranks(_close_joins_private_group, 2, str(tmp_path / "ckpt"))


def _collectives_in_one_order(rank: int, world: int, root: str, out: str) -> None:
    import json
    import threading

    from fastckpt.engine.distributed import Coordinator
    from fastckpt.engine.saver import Saver
    from tests.helpers import GatedStorage

    order: list[str] = []
    gathering, load_started = threading.Event(), threading.Event()

    def recorded(name: str, fn):  # every collective of the private group, in the order this rank issues it
        def wrapped(self, *args, **kwargs):
            order.append(name)
            (gathering if name == "gather" else load_started if name == "share_files" else threading.Event()).set()
            return fn(self, *args, **kwargs)
        return wrapped

    for name in ("assign", "gather", "outcome", "share_files"):
        setattr(Coordinator, name, recorded(name, getattr(Coordinator, name)))
    real_drain = Saver.drain

    def drain(self):
        load_started.set()
        return real_drain(self)

    Saver.drain = drain
    storage = GatedStorage(open_storage(root))
    storage.gate.set()
    with Checkpointer(CheckpointConfig(root=root, persist={"chunk_bytes": 4096}), storage=storage,
                      distributed=True) as ckpt:
        model, opt = _model()
        ckpt.watch(opt)
        first = clone_state({"model": model.state_dict()})
        ckpt.save({"model": model.state_dict()}, step=1).wait()
        gathering.clear()
        if rank == 1:
            storage.gate.clear()  # rank 1's shards of step 2 are held: its commit cannot begin
        with torch.no_grad():
            model[0].weight.add_(1)
        second = clone_state({"model": model.state_dict()})
        handle = ckpt.save({"model": model.state_dict()}, step=2)
        if rank == 0:
            ckpt.wait_staged()  # the seal (the next step's pre-hook): a lazy save commits only once sealed
            assert gathering.wait(60), "rank 0's commit of step 2 never reached its gather"
        else:  # rank 1 lets its commit go only once its load is under way: the worst order for the group
            threading.Thread(target=lambda: load_started.wait(60) and storage.gate.set(), daemon=True).start()
        assert_bit_equal(first, ckpt.load(step=1))
        handle.wait()
        assert_bit_equal(second, ckpt.load(step=2))
    Path(out, f"rank{rank}").write_text(json.dumps(order))


def test_a_load_overlapping_a_commit_issues_the_groups_collectives_in_one_order(tmp_path) -> None:
    """The private gloo group carries collectives from the training thread (plan agreement, loads) and from the
    committer (commits). Rank 0's commit of step 2 waits in its gather while rank 1's is held back; both ranks then
    load step 1. Every rank must issue the group's collectives in the same order (else a load's exchange pairs with
    a commit's on the other rank: a hang, or bytes of the wrong kind), and both loads are bit-exact."""
    import json

    out = tmp_path / "out"
    out.mkdir()
    run_ranks(_collectives_in_one_order, 2, str(tmp_path / "ckpt"), str(out))
    orders = [json.loads((out / f"rank{r}").read_text()) for r in range(2)]
    assert orders[0] == orders[1], orders
    assert orders[0].index("share_files") > orders[0].index("outcome", orders[0].index("gather", 2)), orders[0]
