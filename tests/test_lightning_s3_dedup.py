"""A Lightning Trainer with FastCheckpointIO on an ``s3://`` dirpath: each ``.ckpt`` after the first copies the
previous file's unchanged records server-side (format/torchrecords.py), and every object is a byte-exact stock torch
file that plain ``torch.load`` reads, even once the older files are gone. Real SeaweedFS, bytes counted by a proxy."""
from __future__ import annotations

import fsspec
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from fastckpt import Checkpointer
from fastckpt.format.torchrecords import records_path
from fastckpt.storage.partplan import MIN_PART
from fastckpt_lightning import FastCheckpointIO
from tests.helpers import run_child
from tests.lightning_support import make_trainer
from tests.test_s3_dedup import counted  # noqa: F401 - a fixture

MiB = 1 << 20
FROZEN = 4  # frozen layers of 16 MiB each (a frozen backbone); only the head trains
STEPS = 3


class FrozenBackbone(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.ModuleList([nn.Linear(2048, 2048, bias=False) for _ in range(FROZEN)])
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        return self.head(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.head.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 32), batch_size=4)


class Kept(FastCheckpointIO):
    """Keeps the core Checkpointer it builds, for its dedup figures."""

    def _create_checkpointer(self, config):
        self.core: Checkpointer = super()._create_checkpointer(config)
        return self.core


def test_lightning_ckpts_on_s3_copy_unchanged_records(tmp_path, counted, monkeypatch):
    proxied, counter = counted
    monkeypatch.setitem(fsspec.config.conf, "s3", proxied.storage_options)  # ModelCheckpoint's own listings
    url = proxied.fresh_url("lightning") + "/checkpoints"
    plugin = Kept(storage_options=proxied.storage_options, persist={"fsync": False})
    module = FrozenBackbone()
    trainer = make_trainer([ModelCheckpoint(dirpath=url, every_n_train_steps=1, save_top_k=-1)], plugin,
                           max_steps=STEPS)
    trainer.fit(module)
    stats = plugin.core._saver.dedup
    full = FROZEN * 16 * MiB
    # saves 2 and 3: every frozen record copied; the two changed regions (the pickle at the start, the head and
    # its Adam state at the end) cost at most one 5 MiB part of slack each (measured: ~5.2 MB per save, of 67 MB)
    assert stats.copied >= (STEPS - 1) * (full - 2 * MIN_PART), vars(stats)
    assert stats.fell_back == 0
    assert counter.up <= full + (STEPS - 1) * 2 * MIN_PART + MiB, counter.up
    fs = fsspec.filesystem("s3", **proxied.server.storage_options)
    base = url.removeprefix("s3://")
    names = [f"epoch=0-step={s}.ckpt" for s in range(1, STEPS + 1)]
    assert all(fs.exists(f"{base}/{n}") and fs.exists(records_path(f"{base}/{n}")) for n in names)
    for n in names[:-1]:  # the copy sources go (retention, or by hand): the newest file is whole on its own
        fs.rm(f"{base}/{n}")
    dest = tmp_path / "last.ckpt"
    dest.write_bytes(fs.cat_file(f"{base}/{names[-1]}"))
    code = ("import sys, torch\nck = torch.load(sys.argv[1], weights_only=True)\n"
            "assert 'fastckpt' not in sys.modules\ntorch.save(ck['state_dict'], sys.argv[2])\n")
    done = run_child(code, str(dest), str(tmp_path / "sd.pt"))
    assert done.returncode == 0, done.stderr
    loaded = torch.load(tmp_path / "sd.pt", weights_only=True)
    want = module.state_dict()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)
