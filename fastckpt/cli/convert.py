"""``fastckpt export`` and ``fastckpt import``: leaving fastckpt and coming in, with no lock-in.

``export CKPT OUT --to torch`` writes one file that plain ``torch.load(weights_only=True)`` reads
without fastckpt; from a Lightning checkpoint (also fastckpt 0.1's pointer layout) that file is a
``.ckpt`` stock Lightning resumes from. ``--to safetensors`` writes the model weights as Hugging
Face expects them: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus
``model.safetensors.index.json`` with ``--max-shard-size``. ``import IN ROOT --step N`` saves any
supported checkpoint into a core root through ``Checkpointer.save``. Outputs appear atomically.
"""
from __future__ import annotations

import argparse
import io
import json
import posixpath
import re
from typing import Any

from ..errors import ConfigError, StateMismatchError
from .layout import locate
from .options import CliOptions, checkpoint_config
from .states import DEFAULT_KEY, leaves, load_state, subtree

__all__ = ["export", "import_checkpoint", "parse_size", "run_export", "run_import"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``5GB``, ``500MiB``, ``1000000`` -> bytes (as ``huggingface-cli`` and ``transformers`` spell sizes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"--max-shard-size must be a size such as 5GB or 500MiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def export(src: str, out: str, to: str, opts: CliOptions, key: str | None = None,
           max_shard: int | None = None) -> list[str]:
    """Write ``src`` as ``to`` (``torch`` or ``safetensors``) at ``out``; return the paths written."""
    kind, state = load_state(src, opts.storage_options)
    if to == "torch":
        if key is not None:
            state = subtree(state, key, src)
        buf = io.BytesIO()
        import torch

        torch.save(state, buf)
        _write(out, buf.getvalue(), opts)
        return [out]
    weights = _tensors(subtree(state, key if key is not None else _default_key(kind, state, src), src), src)
    return _write_safetensors(weights, out, max_shard, opts)


def _default_key(kind: str, state: Any, src: str) -> str:
    want = DEFAULT_KEY[kind]
    if isinstance(state, dict) and want in state:
        return want
    keys = sorted(map(str, state)) if isinstance(state, dict) else []
    raise StateMismatchError(f"{src}: no {want!r} subtree to export as model weights; top-level keys: {keys[:50]}. "
                             "Name the weights with --key (dotted for nesting: --key state.model)")


def _tensors(tree: Any, src: str) -> dict[str, Any]:
    """The tensor leaves of ``tree`` under dotted keys, each with its own contiguous storage (safetensors
    refuses tensors that share memory, as tied weights do)."""
    import torch

    out: dict[str, Any] = {}
    for k, leaf in leaves(tree):
        if isinstance(leaf, torch.Tensor):
            out[k] = leaf.detach().to("cpu").contiguous().clone()
    if not out:
        raise StateMismatchError(f"{src}: the chosen subtree holds no tensors; pick another with --key")
    return out


def _write_safetensors(weights: dict[str, Any], out: str, max_shard: int | None, opts: CliOptions) -> list[str]:
    from safetensors.torch import save

    folder, single = (posixpath.dirname(out) or ".", posixpath.basename(out)) if out.endswith(".safetensors") \
        else (out, "model.safetensors")
    shards = _shards(weights, max_shard)
    if len(shards) == 1:
        path = _join(folder, single)
        _write(path, save(shards[0], metadata={"format": "pt"}), opts)
        return [path]
    stem = single.removesuffix(".safetensors")
    names = [f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    written = []
    for name, shard in zip(names, shards):
        written.append(_join(folder, name))
        _write(written[-1], save(shard, metadata={"format": "pt"}), opts)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in weights.values())},
             "weight_map": {k: name for name, shard in zip(names, shards) for k in shard}}
    written.append(_join(folder, f"{single}.index.json"))  # written last: the shards it names exist
    _write(written[-1], json.dumps(index, indent=2).encode(), opts)
    return written


def _shards(weights: dict[str, Any], max_shard: int | None) -> list[dict[str, Any]]:
    """Tensors in order, a new shard whenever the next would pass ``max_shard`` bytes (a tensor larger
    than the limit gets a shard of its own, as in transformers)."""
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for k, t in weights.items():
        n = t.numel() * t.element_size()
        if max_shard is not None and shards[-1] and size + n > max_shard:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    return shards


def _join(folder: str, name: str) -> str:
    return posixpath.join(folder, name)


def _write(path: str, data: bytes, opts: CliOptions) -> None:
    """``data`` at ``path``, atomically (temp name + fsync + rename; one PUT on object stores)."""
    loc = locate(path, opts.storage_options)
    loc.storage.write_atomic(loc.path, data)


def import_checkpoint(src: str, root: str, step: int, opts: CliOptions, name: str | None = None) -> str:
    """Save the checkpoint at ``src`` under core ``root`` at ``step``; return the committed folder."""
    from .. import Checkpointer

    _, state = load_state(src, opts.storage_options)
    with Checkpointer(checkpoint_config(opts, root)) as ckpt:
        info = ckpt.save(state, step=step, name=name).wait()
    return info.path


def run_export(args: argparse.Namespace, opts: CliOptions) -> int:
    if args.max_shard_size is not None and args.to != "safetensors":
        raise ConfigError("--max-shard-size applies to --to safetensors only")
    for path in export(args.ckpt, args.out, args.to, opts, key=args.key, max_shard=args.max_shard_size):
        print(f"wrote  {path}")
    return 0


def run_import(args: argparse.Namespace, opts: CliOptions) -> int:
    path = import_checkpoint(args.src, args.root, args.step, opts, name=args.name)
    print(f"imported  {args.src}  ->  {path}  (step {args.step})")
    return 0
