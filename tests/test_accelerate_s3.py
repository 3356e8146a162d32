"""fastckpt_accelerate against a real S3 server (SeaweedFS): save, retention, resume by latest and by URL."""

from __future__ import annotations

import pytest

import fastckpt_accelerate
from accelerate_testing import Setup, assert_same, fresh_accelerate, make_accelerator  # noqa: F401 (fixture)
from fastckpt import is_checkpoint

pytestmark = pytest.mark.timeout(180)


def test_save_and_resume_through_s3(tmp_path, s3_root):
    config = {"root": s3_root.url, "storage_options": s3_root.storage_options}
    acc = make_accelerator(tmp_path, total_limit=2)
    checkpointing = fastckpt_accelerate.enable(acc, config)
    try:
        setup = Setup(acc)
        snapshots = []
        for _ in range(3):
            setup.step()
            snapshots.append(setup.snapshot())
            path = acc.save_state()
        assert path == f"{s3_root.url}/checkpoint_2"
        checkpointing.wait()
        assert [i.name for i in checkpointing.checkpointer.list()] == ["checkpoint_1", "checkpoint_2"]
        assert not (tmp_path / "checkpoints").exists()  # nothing went to the local project_dir
    finally:
        acc.end_training()

    acc2 = make_accelerator(tmp_path, total_limit=2)
    checkpointing2 = fastckpt_accelerate.enable(acc2, config)
    try:
        setup2 = Setup(acc2, seed=7)
        assert acc2.load_state() == f"{s3_root.url}/checkpoint_2"
        assert_same(snapshots[2], setup2.snapshot())
        assert acc2.save_iteration == 3
        # An explicit s3:// checkpoint, as `load_state("s3://bucket/run/checkpoint_12")`.
        acc2.load_state(f"{s3_root.url}/checkpoint_1")
        assert_same(snapshots[1], setup2.snapshot())
        assert acc2.save_iteration == 2
        assert is_checkpoint(f"{s3_root.url}/checkpoint_1", storage_options=s3_root.storage_options)
        assert checkpointing2.stats == []  # loading does not save
    finally:
        acc2.end_training()
