"""An Accelerator with fastckpt enabled pickles as stock does (issue 23, item 15).

Accelerate's own ``test_can_pickle_dataloader`` pickles a prepared Accelerator; spawn-style launchers do too
(``copy.deepcopy`` returns the Accelerator itself, as stock). The copy is a plain Accelerator: fastckpt's threads and
pending saves stay with the original, which keeps saving through fastckpt.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, skip_first_batches
from accelerate.utils import DataLoaderConfiguration

import fastckpt_accelerate
from accelerate_testing import Setup, assert_same, closing, fresh_accelerate, make_accelerator  # noqa: F401

pytestmark = pytest.mark.timeout(120)


def _is_stock(accelerator: Accelerator, name: str) -> bool:
    method = getattr(accelerator, name)
    return getattr(method, "__func__", None) is getattr(Accelerator, name) and method.__self__ is accelerator


@pytest.mark.parametrize("dispatch_batches", [True, False])
def test_prepared_dataloaders_pickle_with_the_accelerator_as_stock(tmp_path, closing, dispatch_batches):
    """Accelerate's test_can_pickle_dataloader, with fastckpt enabled."""
    data = torch.utils.data.TensorDataset(torch.arange(10))
    dl = torch.utils.data.DataLoader(data)
    skip_dl = skip_first_batches(dl, 2)
    accelerator = make_accelerator(
        tmp_path, dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch_batches))
    closing.append(fastckpt_accelerate.enable(accelerator))
    original_dl, _ = accelerator.prepare(dl, skip_dl)

    loaded = pickle.loads(pickle.dumps(accelerator))

    assert len(loaded._dataloaders) == 2
    expected = DataLoaderDispatcher if dispatch_batches else DataLoaderShard
    assert isinstance(loaded._dataloaders[0], expected)
    assert [b for b in loaded._dataloaders[0]] == [b for b in original_dl]
    assert [b for b in loaded._dataloaders[1]] == [b for b in original_dl][2:]


def test_copy_is_a_plain_accelerator_and_the_original_keeps_saving(tmp_path, closing):
    accelerator = make_accelerator(tmp_path)
    checkpointing = fastckpt_accelerate.enable(accelerator)
    closing.append(checkpointing)
    setup = Setup(accelerator)
    setup.step()
    accelerator.save_state()  # pending while the copy is made: nothing of it travels
    expected = setup.snapshot()

    clone = pickle.loads(pickle.dumps(accelerator))
    assert copy.deepcopy(accelerator) is accelerator  # as stock: Accelerator.__deepcopy__ returns itself

    assert fastckpt_accelerate.get_checkpointing(clone) is None
    assert all(_is_stock(clone, name) for name in ("save_state", "load_state", "end_training"))
    # The original is untouched: still routed, and its save restores bit for bit.
    assert fastckpt_accelerate.get_checkpointing(accelerator) is checkpointing
    assert not any(_is_stock(accelerator, name) for name in ("save_state", "load_state", "end_training"))
    setup.step()
    accelerator.load_state()
    actual = setup.snapshot()
    for key in ("model", "optimizer", "scheduler", "counter"):
        assert_same(expected[key], actual[key], key)
    accelerator.end_training()  # the routed end_training still flushes and closes
    assert checkpointing.closed
