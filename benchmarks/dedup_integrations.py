"""Bytes sent per checkpoint of the LoRA fine-tune through the integrations, straight to ``s3://`` (no local tier):
Accelerate's ``save_state`` (a new ``checkpoint_N/`` folder every save, its files copied server-side from the
previous folder's, ``format/bundlededup.py``) and Lightning's ``FastCheckpointIO`` (one ``.ckpt`` per save in the
``ModelCheckpoint`` dirpath, copied from the folder's newest ``.ckpt``, ``format/torchrecords.py``); and Accelerate
into a local ``project_dir`` with a remote tier (``remote.url``: the upload of each folder, copied from the previous
uploaded folder, ``tiers/dedup.py``). Bytes counted on
the wire by the same proxy as ``dedup.py``; part of ``python -m benchmarks.dedup``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["integration_markdown", "measure_integrations"]


def _accelerate(model: torch.nn.Module, opt: torch.optim.Optimizer, url: str, options: dict[str, Any], work: Path,
                fs: Any) -> tuple[Callable[[int], int], Callable[[], None]]:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    import fastckpt_accelerate

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(work / "acc-project"),
                                                                    automatic_checkpoint_naming=True))
    acc.prepare(model, opt)
    fast = fastckpt_accelerate.enable(acc, {"root": url, "storage_options": options, "health": {"enabled": False}})

    def save(step: int) -> int:
        folder = acc.save_state()
        fast.wait()
        return int(fs.du(folder.removeprefix("s3://")))

    return save, acc.end_training


def _accelerate_remote(model: torch.nn.Module, opt: torch.optim.Optimizer, url: str, options: dict[str, Any],
                       work: Path, fs: Any) -> tuple[Callable[[int], int], Callable[[], None]]:
    """Accelerate into a local ``project_dir`` with a remote tier on ``url``: what its uploads send."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    import fastckpt_accelerate

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(work / "acc-remote-project"),
                                                                    automatic_checkpoint_naming=True))
    acc.prepare(model, opt)
    fast = fastckpt_accelerate.enable(acc, {"remote": {"url": url, "storage_options": options},
                                            "health": {"enabled": False}})

    def save(step: int) -> int:
        folder = Path(acc.save_state())
        fast.wait()  # the upload too
        return int(fs.du(f"{url.removeprefix('s3://')}/{folder.name}"))

    return save, acc.end_training


def _lightning(model: torch.nn.Module, opt: torch.optim.Optimizer, url: str, options: dict[str, Any], work: Path,
               fs: Any) -> tuple[Callable[[int], int], Callable[[], None]]:
    from fastckpt_lightning import FastCheckpointIO

    plugin = FastCheckpointIO({"health": {"enabled": False}}, storage_options=options, persist={"fsync": False})

    def save(step: int) -> int:
        ckpt = {"epoch": 0, "global_step": step, "state_dict": model.state_dict(),
                "optimizer_states": [opt.state_dict()], "lr_schedulers": []}
        path = f"{url}/epoch=0-step={step}.ckpt"
        plugin.save_checkpoint(ckpt, path)
        plugin.flush()
        return int(fs.size(path.removeprefix("s3://")))

    return save, plugin.teardown


CASES = {"accelerate": _accelerate, "accelerate-remote": _accelerate_remote, "lightning": _lightning}


def measure_integrations(model_of: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
                         train: Callable[[torch.nn.Module, torch.optim.Optimizer, int], None],
                         changed_of: Callable[[Any, Any], tuple[int, int]], digests_of: Callable[[Any], Any],
                         count: Any, server: Any, endpoint: str, saves: int, part: int, work: Path,
                         only: set[str] | None = None) -> dict[str, Any]:
    """Per integration: each save's size and the bytes on the wire; ``changed_of``/``digests_of`` as ``dedup.py``'s
    (the tensors whose bytes changed, over the model's and optimizer's state)."""
    import s3fs

    from tests.s3server import s3_storage_options

    fs = s3fs.S3FileSystem(**server.storage_options)  # sizes straight from the server, not counted
    out: dict[str, Any] = {}
    for name, start in CASES.items():
        if only is not None and name not in only:
            continue
        model, opt = model_of()
        url = server.fresh_url(f"dedup-{name}")
        save, close = start(model, opt, url, s3_storage_options(endpoint), work, fs)
        rows, prev = [], None
        try:
            for step in range(1, saves + 1):
                train(model, opt, step)
                digests = digests_of({"model": model.state_dict(), "optimizer": opt.state_dict()})
                count.up = 0
                size = save(step)
                changed, regions = changed_of(prev, digests) if prev else (size, 1)
                files = 4 if name.startswith("accelerate") else 1  # each file's fixed bytes (header, pickle) may change
                rows.append({"step": step, "size": size, "sent_wire": count.up, "changed": changed,
                             "regions": regions, "bound": changed + (regions + files) * part + 128 * 1024})
                prev = digests
        finally:
            close()
        out[name] = {"rows": rows}
    return out


def integration_markdown(res: dict[str, Any] | None) -> list[str]:
    if not res:
        return []
    if "error" in res:
        return [f"Through the integrations: n/a ({res['error']})", ""]

    def med(rows: list[dict], key: str) -> float:
        vals = sorted(r[key] for r in rows[1:]) or [rows[0][key]]
        return vals[len(vals) // 2]

    md = ["Through the integrations, LoRA case, straight to `s3://` (no local tier; same proxy, same median), and "
          "Accelerate into a local `project_dir` with `remote.url` (what its uploads send): "
          "Accelerate `save_state` writes a new `checkpoint_N/` each save (its files copied server-side from "
          "`checkpoint_{N-1}`'s, whose records its `manifest.json` lists); Lightning's `FastCheckpointIO` one `.ckpt` "
          "per save in the dirpath (copied from the folder's newest `.ckpt`). 'bound' = changed + one 5 MiB part "
          "per changed region and per file + 128 KiB.", "",
          "| integration | checkpoint size | sent per checkpoint | changed | bound | within bound |",
          "|---|---|---|---|---|---|"]
    names = {"accelerate": "Accelerate `save_state` folder", "lightning": "Lightning `.ckpt`",
             "accelerate-remote": "Accelerate `save_state`, local `project_dir` + `remote.url` (the upload)"}
    for name, r in res.items():
        rows = r["rows"]
        within = all(x["sent_wire"] <= x["bound"] for x in rows[1:])
        md.append(f"| {names[name]} | {med(rows, 'size') / 1e6:.1f} MB | **{med(rows, 'sent_wire') / 1e6:.2f} MB** "
                  f"| {med(rows, 'changed') / 1e6:.2f} MB | {med(rows, 'bound') / 1e6:.1f} MB | "
                  f"{'yes' if within else 'NO'} |")
    return md + [""]
