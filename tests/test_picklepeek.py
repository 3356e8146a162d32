"""format/picklepeek.py: a torch file's tree read without torch, and without running anything the file names."""
from __future__ import annotations

import io
import json
import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import torch

from fastckpt.cli import main
from fastckpt.cli.layout import FileView, locate
from fastckpt.format.picklepeek import Opaque, TensorStub, peek, scalar_value


class _Boom:
    """Pickles as a call to ``os.system``: what a hostile checkpoint holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _view(path: Path) -> FileView:
    return FileView(locate(str(path), {}))


def test_tensors_and_plain_values_of_a_torch_file(tmp_path) -> None:
    state = {"global_step": 12, "epoch": 3, "sd": OrderedDict(w=torch.arange(6, dtype=torch.float64).view(2, 3)),
             "step": torch.tensor(41.0), "count": torch.tensor(7), "groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
    torch.save(state, tmp_path / "a.ckpt")
    view = _view(tmp_path / "a.ckpt")
    peeked = peek(view, "a.ckpt")
    tree = peeked.tree
    assert peeked.plain and tree["global_step"] == 12 and tree["groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}]
    w = tree["sd"]["w"]
    assert isinstance(tree["sd"], OrderedDict) and isinstance(w, TensorStub)
    assert (w.dtype, w.shape, w.nbytes) == ("float64", (2, 3), 48)
    assert scalar_value(view, tree["step"]) == 41.0 and scalar_value(view, tree["count"]) == 7
    assert scalar_value(view, w) is None  # not one element


def test_a_hostile_pickle_runs_nothing_and_is_foreign_to_list(tmp_path, capsys) -> None:
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save({"global_step": 5, "x": _Boom(marker)}, buf)  # torch.save pickles the reduce as is
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "last.ckpt").write_bytes(buf.getvalue())
    peeked = peek(_view(tmp_path / "ckpts" / "last.ckpt"), "last.ckpt")
    assert not marker.exists()
    assert isinstance(peeked.tree["x"], Opaque) and peeked.tree["x"].name in ("posix.system", "os.system")
    assert not peeked.plain  # list then asks torch's safe loader, which refuses it
    assert main(["list", str(tmp_path / "ckpts"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"]) for r in rows] == [("last.ckpt", "foreign")] and not marker.exists()


def test_no_data_pkl_is_an_integrity_error(tmp_path) -> None:
    with zipfile.ZipFile(tmp_path / "z.ckpt", "w") as z:
        z.writestr("archive/other", pickle.dumps(1))
    try:
        peek(_view(tmp_path / "z.ckpt"), "z.ckpt")
    except Exception as e:  # noqa: BLE001 - the type is what is checked
        assert type(e).__name__ == "IntegrityError" and "z.ckpt" in str(e) and "data.pkl" in str(e)
    else:
        raise AssertionError("peek read a zip without data.pkl")
