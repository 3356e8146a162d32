"""The fastckpt command."""
from __future__ import annotations

import torch

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.cli import main


def test_list_verify_inspect(tmp_path, capsys) -> None:
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save({"w": torch.ones(4, 4), "n": 3}, step=7).wait()
    assert main(["list", str(tmp_path)]) == 0
    assert "step-000000007" in capsys.readouterr().out
    path = str(tmp_path / "step-000000007")
    assert main(["verify", path]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["inspect", path]) == 0
    assert "float32" in capsys.readouterr().out
    shard = next((tmp_path / "step-000000007").glob("shard-*"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["verify", path]) == 1
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and shard.name in err and "'w'" in err
