"""The DCP peer's stager outlives ``async_save``'s ``close()`` (torch 2.11 closes the stager it is given after each
upload; the GPU run's DCP peer then fell back with ``KeyError: <class 'type'>`` at its second checkpoint)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch.distributed.checkpoint.staging", reason="this torch has no DCP DefaultStager")

from benchmarks.dcpstager import kept_stager  # noqa: E402


def _options() -> dict:
    return dict(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                use_non_blocking_copy=False)


def test_a_closed_default_stager_fails_as_the_gpu_run_did():
    """The cause, on this torch: a DefaultStager closed, then asked to stage, raises the GPU run's error."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(**_options()))
    stager.close()
    with pytest.raises(KeyError, match="type"):
        stager.stage({"w": torch.randn(3)})


def test_the_kept_stager_stages_after_close_and_release_closes_it():
    state = {"w": torch.randn(64), "b": torch.arange(5)}
    stager = kept_stager(**_options())
    first = stager.stage(state)
    stager.close()  # what torch 2.11's async_save does after each upload
    state["w"].add_(1)
    second = stager.stage(state)
    assert torch.equal(second["w"], state["w"]) and torch.equal(second["b"], state["b"])
    assert first is not None
    stager.release()
    with pytest.raises(KeyError):
        stager.stage(state)
