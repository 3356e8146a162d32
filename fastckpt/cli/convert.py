"""``fastckpt export`` and ``fastckpt import``: leaving fastckpt and coming in, with no lock-in.

``export CKPT OUT --to torch`` writes one file that plain ``torch.load(weights_only=True)`` reads
without fastckpt; from a Lightning checkpoint (also fastckpt 0.1's pointer layout) that file is a
``.ckpt`` stock Lightning resumes from. ``--to safetensors`` writes the model weights as Hugging
Face expects them: ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus
``model.safetensors.index.json`` with ``--max-shard-size``. ``import IN ROOT [--step N]`` saves any
supported checkpoint into a core root through ``Checkpointer.save``, at the step it records unless
told. Outputs appear atomically.
"""
from __future__ import annotations

import argparse
import io
import json
import posixpath
import re
from typing import Any, Callable

from ..errors import ConfigError, StateMismatchError
from .layout import accelerate_step, checkpoint_bytes, locate
from .options import CliOptions, checkpoint_config
from .progress import ByteProgress, CountingStorage, wanted
from .text import clean
from .states import DEFAULT_KEY, leaves, load_state, subtree

__all__ = ["export", "import_checkpoint", "recorded_step", "read_source", "parse_size", "run_export", "run_import"]

Count = Callable[[int], None]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """``5GB``, ``500MiB``, ``1000000`` -> bytes (as ``huggingface-cli`` and ``transformers`` spell sizes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"--max-shard-size must be a size such as 5GB or 500MiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def export(src: str, out: str, to: str, opts: CliOptions, key: str | None = None,
           max_shard: int | None = None, show: bool = False) -> list[str]:
    """Write ``src`` as ``to`` (``torch`` or ``safetensors``) at ``out``; return the paths written. ``show``:
    progress in bytes on stderr, reading then writing (``fastckpt.cli.progress``)."""
    kind, state = read_source(src, opts, show)
    if to == "torch":
        if key is not None:
            state = subtree(state, key, src)
        buf = io.BytesIO()
        import torch

        torch.save(state, buf)
        with ByteProgress(f"writing {out}", buf.tell(), show) as bar:
            _write(out, buf.getvalue(), opts, bar.add)
        return [out]
    weights = _tensors(subtree(state, key if key is not None else _default_key(kind, state, src), src), src)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    with ByteProgress(f"writing {out}", total, show) as bar:
        return _write_safetensors(weights, out, max_shard, opts, bar.add)


def read_source(src: str, opts: CliOptions, show: bool) -> tuple[str, Any]:
    """``load_state(src)``, its bytes counted on a progress line when ``show``."""
    if not show:
        return load_state(src, opts.storage_options)
    with ByteProgress(f"reading {src}", checkpoint_bytes(src, opts.storage_options), True) as bar:
        return load_state(src, opts.storage_options, bar.add)


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


def _write_safetensors(weights: dict[str, Any], out: str, max_shard: int | None, opts: CliOptions,
                       count: Count | None = None) -> list[str]:
    from safetensors.torch import save

    folder, single = (posixpath.dirname(out) or ".", posixpath.basename(out)) if out.endswith(".safetensors") \
        else (out, "model.safetensors")
    shards = _shards(weights, max_shard)
    if len(shards) == 1:
        path = _join(folder, single)
        _write(path, save(shards[0], metadata={"format": "pt"}), opts, count)
        return [path]
    stem = single.removesuffix(".safetensors")
    names = [f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    written = []
    for name, shard in zip(names, shards):
        written.append(_join(folder, name))
        _write(written[-1], save(shard, metadata={"format": "pt"}), opts, count)
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


def _write(path: str, data: bytes, opts: CliOptions, count: Count | None = None) -> None:
    """``data`` at ``path``, atomically (temp name + fsync + rename; one PUT on object stores)."""
    loc = locate(path, opts.storage_options)
    loc.storage.write_atomic(loc.path, data)
    if count is not None:
        count(len(data))


def import_checkpoint(src: str, root: str, step: int | None, opts: CliOptions, name: str | None = None,
                      show: bool = False) -> tuple[str, int]:
    """Save the checkpoint at ``src`` under core ``root``; return the committed folder and its step.

    ``step=None`` takes the step the source records: a Lightning ``.ckpt``'s ``global_step``, a core
    checkpoint's manifest step, the training step of an Accelerate folder. A source that records none (a
    plain ``torch.save`` file, most DCP folders) is refused, naming ``--step``: never a guessed step."""
    from .. import Checkpointer, open_storage

    kind, state = read_source(src, opts, show)
    if step is None:
        step = recorded_step(src, kind, state, opts)
    # Nothing trains here: the state is copied inside save(), which is what staging.mode eager says (and it
    # keeps the "copies all tensors inside save()" advice, meant for training loops, off the command line).
    config = checkpoint_config(opts, root, staging={"mode": "eager"})
    total = sum(t.numel() * t.element_size() for _, t in leaves(state) if _is_tensor(t))
    with ByteProgress(f"writing {root}", total, show) as bar:
        # Counted only while someone watches: the wrapper hides LocalStorage's own write paths from the saver.
        storage = CountingStorage(open_storage(root, opts.storage_options), bar.add) if show else None
        with Checkpointer(config, storage=storage) as ckpt:
            info = ckpt.save(state, step=step, name=name).wait()
    return info.path, step


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def recorded_step(src: str, kind: str, state: Any, opts: CliOptions) -> int:
    """The step the checkpoint at ``src`` records (see ``import_checkpoint``); ``ConfigError`` when none."""
    found = state.get("global_step") if isinstance(state, dict) else None
    if type(found) is int and found >= 0:
        return found
    if kind == "accelerate" and (found := accelerate_step(locate(src, opts.storage_options))) is not None:
        return found  # the optimizer's step count, as `list` shows it
    if kind == "core":
        from ..format.manifest import MANIFEST, parse_manifest

        loc = locate(src, opts.storage_options)
        mpath = loc.storage.join(loc.path, MANIFEST)
        if loc.storage.exists(mpath):
            doc = parse_manifest(loc.storage.read_bytes(mpath), mpath)
            meta = (doc.get("user") or {}).get("fastckpt_accelerate")
            return meta["step"] if isinstance(meta, dict) and type(meta.get("step")) is int else doc["step"]
    raise ConfigError(f"{src} records no training step (no integer 'global_step' in it, no manifest step, no "
                      "optimizer step count); "
                      "pass the step to import it at with --step N")


def run_export(args: argparse.Namespace, opts: CliOptions) -> int:
    if args.max_shard_size is not None and args.to != "safetensors":
        raise ConfigError("--max-shard-size applies to --to safetensors only")
    for path in export(args.ckpt, args.out, args.to, opts, key=args.key, max_shard=args.max_shard_size,
                       show=wanted(args.progress)):
        print(f"wrote  {clean(path)}")
    return 0


def run_import(args: argparse.Namespace, opts: CliOptions) -> int:
    path, step = import_checkpoint(args.src, args.root, args.step, opts, name=args.name, show=wanted(args.progress))
    origin = "" if args.step is not None else ", as recorded in it"
    print(clean(f"imported  {args.src}  ->  {path}  (step {step}{origin})"))
    return 0
