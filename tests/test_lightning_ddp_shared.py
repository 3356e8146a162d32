"""Four (and two) CPU processes with ``FastDDPStrategy``: every rank writes its share of each ``.ckpt``, rank 0
commits it.

Lightning's DDP launcher starts the second rank by re-running the command line, so each phase runs this file as a
script (as ``test_lightning_ddp.py`` does). Each rank trains on batches of its own, so BatchNorm's running statistics
differ between the ranks, as they do under DDP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from fastckpt.format.health import HEALTH_ATTR

HERE = Path(__file__).resolve().parent
STOP_AT, TOTAL_STEPS = 3, 6

pytestmark = pytest.mark.slow


def _run_phase(root: Path, phase: str, ok: bool = True, devices: int = 2) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    from rank_logs import run_phase

    code, err, report = run_phase([sys.executable, __file__, phase, str(root), str(devices)], env,
                                  root / f"{phase}-logs", 400)
    assert (code == 0) == ok, f"{phase} exited {code}:\n{report}"
    return err


def _result(root: Path, phase: str, rank: int) -> dict[str, Any]:
    return torch.load(root / f"{phase}-rank{rank}.pt", weights_only=False)


def test_ranks_share_each_file_and_an_interrupted_run_resumes_bit_exact(tmp_path) -> None:
    from helpers import assert_bit_equal

    # Four ranks: each file split four ways (the middle ranks' parts too). A 2-rank run of this test (until issue 55)
    # took the same code paths with fewer parts; test_lightning_ddp.py resumes 2 ranks against a straight run.
    # The reference is stock Lightning (DDPStrategy, torch.save on rank 0) interrupted and resumed at the same step,
    # since a straight run differs from a resumed one here even with stock Lightning (DDP rebuilds its gradient
    # buckets at a resume's first step, which changes the order in which gloo's ring sums 4 ranks' floats).
    # The stock reference trains and resumes in one launch (a fresh Trainer and module for its resume: see _main);
    # fastckpt's train and resume stay two launches, since a resume in a new process is what this test proves.
    devices, reference = 4, "stock-resume"
    _run_phase(tmp_path, "stock", devices=devices)
    _run_phase(tmp_path, "train", devices=devices)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [".fastckpt.lock", "epoch=0-step=3.ckpt", "last.ckpt"], \
        "top-k removed the older files, and no temporary file is left"
    for path in ("epoch=0-step=3.ckpt", "last.ckpt"):  # each shared file's health record: its extended attribute
        record = json.loads(os.getxattr(ckpt / path, HEALTH_ATTR))
        assert record["health"]["healthy"] is True and record["health"]["complete"] is True, record

    train = [_result(tmp_path, "train", rank) for rank in range(devices)]
    for path in ("epoch=0-step=3.ckpt", "last.ckpt"):
        parts = [r["written"][str(ckpt / path)] for r in train]
        print(f"{path}: the ranks wrote {[w for w, _ in parts]} bytes of {parts[0][1]}")
        assert all(w > 0 for w, _ in parts), f"every rank wrote part of {path}: {parts}"
        assert sum(w for w, _ in parts) == parts[0][1] == (ckpt / path).stat().st_size

    # The file: parameters and AdamW state as both ranks hold them, BatchNorm's running statistics rank 0's.
    saved = torch.load(ckpt / "last.ckpt", weights_only=True)
    at_save = [r["by_step"][STOP_AT] for r in train]
    assert_bit_equal(saved["state_dict"], at_save[0]["state_dict"])
    assert_bit_equal(saved["optimizer_states"], at_save[0]["optimizer_states"])
    # what stock Lightning saved at that step (its last.ckpt before it resumed, copied aside), bit for bit
    stock = torch.load(tmp_path / "stock-at-stop.ckpt", weights_only=True)
    assert stock["global_step"] == STOP_AT
    assert_bit_equal(saved["state_dict"], stock["state_dict"])
    assert_bit_equal(saved["optimizer_states"], stock["optimizer_states"])
    assert_bit_equal(at_save[1]["state_dict"]["net.0.weight"], at_save[0]["state_dict"]["net.0.weight"])
    for buffer in ("net.1.running_mean", "net.1.running_var"):  # rank 1's own: had it written them, this would fail
        assert not torch.equal(at_save[1]["state_dict"][buffer], at_save[0]["state_dict"][buffer]), buffer

    # A genuine torch file: plain torch (no fastckpt imported) loads it, and any zip tool verifies it.
    check = ("import sys, torch; s = torch.load(sys.argv[1], weights_only=True); "
             "assert not any(m.startswith('fastckpt') for m in sys.modules); print(s['global_step'])")
    done = subprocess.run([sys.executable, "-c", check, str(ckpt / "last.ckpt")], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert done.returncode == 0 and done.stdout.strip() == str(STOP_AT), done.stderr[-3000:]
    done = subprocess.run([sys.executable, "-m", "zipfile", "-t", str(ckpt / "epoch=0-step=3.ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Done testing" in done.stdout, done.stdout + done.stderr
    with zipfile.ZipFile(ckpt / "last.ckpt") as z:
        assert z.testzip() is None
    from lightning_models import TinyModule

    loaded = TinyModule.load_from_checkpoint(ckpt / "last.ckpt", map_location="cpu")  # Lightning's own reader
    assert_bit_equal(loaded.state_dict(), at_save[0]["state_dict"])

    _run_phase(tmp_path, "resume", devices=devices)
    for rank in range(devices):
        resumed, expected = _result(tmp_path, "resume", rank), _result(tmp_path, reference, rank)
        assert resumed["start_step"] == STOP_AT, "the rank did not restore the checkpoint"
        assert expected["start_step"] == STOP_AT, "the stock reference's resume did not restore its checkpoint"
        assert_bit_equal(resumed["state"], expected["state"])
    assert torch.load(ckpt / "last.ckpt", weights_only=True)["global_step"] == TOTAL_STEPS


def test_a_write_failing_on_rank_1_fails_that_file_on_both_ranks(tmp_path) -> None:
    err = _run_phase(tmp_path, "fail", ok=False)
    for rank in (0, 1):  # the same error on both ranks, naming the rank and the file, raised once on each
        raised = [line for line in err.splitlines() if line.startswith(f"[rank{rank}]: fastckpt.errors.StorageError")]
        assert len(raised) == 1, err[-6000:]
        assert "'epoch=0-step=2.ckpt'" in raised[0] and "rank 1: [Errno 28] injected: ENOSPC" in raised[0], raised
    ckpt = tmp_path / "ckpt"
    names = sorted(p.name for p in ckpt.iterdir())
    assert "epoch=0-step=2.ckpt" not in names and not any("fastckpt-tmp" in n for n in names), names
    assert torch.load(ckpt / "epoch=0-step=1.ckpt", weights_only=True)["global_step"] == 1


def test_rank_1_killed_while_writing_leaves_no_file_for_that_step(tmp_path) -> None:
    _run_phase(tmp_path, "kill", ok=False)
    assert (tmp_path / "killed-mid-write").exists(), "rank 1 died somewhere else"
    ckpt = tmp_path / "ckpt"
    names = sorted(p.name for p in ckpt.iterdir())
    assert "epoch=0-step=2.ckpt" not in names, names
    assert all(n.startswith(".") for n in names if n != "epoch=0-step=1.ckpt"), names  # at most a hidden temporary
    assert torch.load(ckpt / "epoch=0-step=1.ckpt", weights_only=True)["global_step"] == 1
    with zipfile.ZipFile(ckpt / "epoch=0-step=1.ckpt") as z:
        assert z.testzip() is None


@pytest.mark.parametrize("shared_writes,nodes,path,shares", [
    (None, 1, "/ckpt/a.ckpt", True), (None, 1, "file:///ckpt/a.ckpt", True), (None, 2, "/ckpt/a.ckpt", False),
    (None, 1, "s3://bucket/a.ckpt", True), (None, 2, "s3://bucket/a.ckpt", True), (True, 2, "/ckpt/a.ckpt", True),
    (True, 1, "s3://bucket/a.ckpt", True), (None, 1, "gs://bucket/a.ckpt", False), (True, 1, "gs://bucket/a.ckpt", None),
    (False, 1, "/ckpt/a.ckpt", False), (False, 1, "s3://bucket/a.ckpt", False),
])
def test_which_saves_the_ranks_share(shared_writes, nodes, path, shares) -> None:
    from fastckpt import ConfigError
    from fastckpt_lightning import FastDDPStrategy

    class Ranks(FastDDPStrategy):
        world_size = 4  # as set up by the launcher

    strategy = Ranks(shared_writes=shared_writes)
    strategy.num_nodes = nodes
    if shares is None:  # only S3 takes the parts of one object from several writers (engine/sharedobject.py)
        with pytest.raises(ConfigError, match="only S3"):
            strategy.shares(path)
    else:
        assert strategy.shares(path) is shares
    single = FastDDPStrategy(shared_writes=True)
    assert single.world_size == 1 and single.shares("/ckpt/a.ckpt") is False  # one process: nothing to share
    with pytest.raises(ConfigError):
        FastDDPStrategy(shared_writes="auto")


def _replaced(rank: int, world: int, folder: str) -> None:
    from fastckpt_lightning import FastCheckpointIO

    plugin = FastCheckpointIO(persist={"fsync": False})
    if rank == 0:  # rank 0 alone removed a file here first (only it removes): a one-process Checkpointer
        plugin._folder(folder).remove_file("old.ckpt").result()
    ckpt = plugin._folder(folder, distributed=True)  # the first shared save: built on every rank together
    assert ckpt.distributed and plugin._folder(folder, distributed=True) is ckpt
    ckpt.save_file({"w": torch.full((64,), float(rank)), "step": 1}, "new.ckpt", step=1).wait()
    plugin.teardown()


def test_a_folder_rank_0_removed_from_first_gets_the_shared_checkpointer(tmp_path) -> None:
    from tests.dist_launcher import run_ranks

    (tmp_path / "old.ckpt").write_bytes(b"old")
    run_ranks(_replaced, 2, str(tmp_path))
    assert not (tmp_path / "old.ckpt").exists()
    assert torch.load(tmp_path / "new.ckpt", weights_only=True)["w"].eq(0).all(), "rank 0's unwatched tensor"


# ---- the script (every rank) -------------------------------------------------------------------------------------


def _main(phase: str, root: Path, devices: int) -> None:
    import errno
    import shutil

    import torch.distributed as dist
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from fastckpt import Checkpointer, open_storage
    from fastckpt_lightning import FastCheckpointIO, FastDDPStrategy
    from helpers import WrappedStorage
    from lightning_support import ResumableBatches, RecordAfterStep, TinyModule, make_trainer, training_state

    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's launcher sets it for the ranks it starts

    class RankBatches(ResumableBatches):
        """Each rank's own batches (as a DistributedSampler gives): BatchNorm's statistics differ per rank."""

        def __init__(self) -> None:
            super().__init__()
            self._batches = [(x + rank, y) for x, y in self._batches]

    class Faulty(WrappedStorage):
        """Rank 1's writes into the step-2 file fail (a full disk), or kill it halfway (``kill``)."""

        def write_at(self, path: str, pieces: Any) -> None:
            if "step=2.ckpt" in path and phase == "kill":
                offset, data = pieces[0]
                self.inner.write_at(path, [(offset, data[: len(data) // 2])])
                (root / "killed-mid-write").touch()
                os.kill(os.getpid(), 9)
            if "step=2.ckpt" in path:
                raise OSError(errno.ENOSPC, "injected: ENOSPC", path)
            self.inner.write_at(path, pieces)

    class FaultyIO(FastCheckpointIO):
        def _create_distributed_checkpointer(self, config: Any) -> Checkpointer:
            storage = open_storage(config.root)
            return Checkpointer(config, storage=Faulty(storage) if dist.get_rank() == 1 else storage, distributed=True)

    class StartStep(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.step = trainer.global_step

    def fit(phase: str) -> None:
        start, record = StartStep(), RecordAfterStep()
        faulty = phase in ("fail", "kill")
        stock = phase.startswith("stock-")  # DDPStrategy and torch.save on rank 0: the reference
        io_class = FaultyIO if faulty else FastCheckpointIO
        plugin = None if stock else io_class(persist={"fsync": False, "chunk_bytes": 4096})
        keep = -1 if faulty else 1
        checkpoints = ModelCheckpoint(dirpath=root / ("stock" if stock else "ckpt"), every_n_train_steps=1,
                                      save_top_k=keep, save_last=not faulty)
        callbacks: list[Any] = [start, record, checkpoints]
        max_steps = {"train": STOP_AT, "stock-train": STOP_AT, "fail": 4, "kill": 4}.get(phase, TOTAL_STEPS)
        strategy = DDPStrategy() if stock else FastDDPStrategy()
        trainer = make_trainer(callbacks, plugin, devices=devices, strategy=strategy, max_steps=max_steps)
        module = TinyModule(batchnorm=True)
        trainer.fit(module, RankBatches(), ckpt_path="last" if phase.endswith("resume") else None)
        assert trainer.global_rank == rank
        written = {s.path: (s.written_bytes, s.nbytes) for s in plugin.stats} if plugin is not None else {}
        result = {"start_step": start.step, "state": training_state(module), "by_step": record.by_step,
                  "written": written}
        torch.save(result, root / f"{phase}-rank{rank}.pt")

    if phase != "stock":
        fit(phase)
        return
    # The stock reference, interrupted and resumed in one launch (its ranks' imports cost more than its training):
    # the resume gets a fresh Trainer, strategy, module and batches, and restores everything from last.ckpt, as a new
    # process would (the process group stays: Lightning reuses an initialized one, and launches no ranks again since
    # rank 0's launcher set LOCAL_RANK). Rank 0 alone writes stock/ files: its copy of last.ckpt at STOP_AT is done
    # before its resume saves again.
    fit("stock-train")
    if rank == 0:
        shutil.copyfile(root / "stock" / "last.ckpt", root / "stock-at-stop.ckpt")
    fit("stock-resume")


if __name__ == "__main__":
    from rank_logs import split_rank_output

    split_rank_output()
    _main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
