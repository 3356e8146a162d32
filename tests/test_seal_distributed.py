"""A snapshot refused at one rank's seal fails the checkpoint on every rank, and no rank hangs (2 gloo ranks)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, FastCkptError, SnapshotMutatedError
from tests.dist_launcher import run_ranks
from tests.helpers import assert_bit_equal, clone_state

pytestmark = pytest.mark.slow


def _one_rank_refuses(rank: int, world: int, root: str) -> None:
    # retake acts as raise with distributed=True: every rank would have to take it again together
    cfg = CheckpointConfig(root=root, persist={"chunk_bytes": 4096}, staging={"on_mutation": "retake"})
    with Checkpointer(cfg, distributed=True) as ckpt:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(8)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ckpt.watch(opt)  # watched tensors are spread over both ranks
        state = clone_state(model.state_dict())
        ckpt.save(model.state_dict(), step=1).wait()
        h = ckpt.save(model.state_dict(), step=2)
        if rank == 1:
            for p in model.parameters():
                p.data.mul_(2)  # no version bump: only the seal's byte sample sees it
        err = SnapshotMutatedError if rank == 1 else FastCkptError
        with pytest.raises(err) as ei:
            h.wait(60)  # seals on this rank, then the commit vote: bounded, never a hang
        if rank == 1:
            assert ".data" in str(ei.value)
        assert ckpt.latest() == 1
        assert_bit_equal(state, ckpt.load())


def test_a_refusal_on_one_rank_fails_the_checkpoint_on_every_rank(tmp_path) -> None:
    run_ranks(_one_rank_refuses, 2, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "step-000000002" / "manifest.json").exists()
