"""The ``fastckpt`` command (also ``python -m fastckpt``).

    fastckpt list ROOT [--json] [--remote URL]    checkpoints under a core root, a Lightning dirpath or an
                                                  Accelerate checkpoints/ folder
    fastckpt inspect CKPT [--json]                the state tree: keys, dtypes, shapes, bytes
    fastckpt verify CKPT|ROOT... [--progress]     every checksum (of every checkpoint under a ROOT); exit 1 and one
                                                  line per bad file
    fastckpt export CKPT OUT --to torch|safetensors [--key K] [--max-shard-size 5GB]
    fastckpt import IN ROOT [--step N]            torch.save file, .ckpt, Accelerate or DCP folder -> core
    fastckpt gc ROOT [--keep-last N [--keep-every S]] [--grace-s S] [--dry-run]
    fastckpt persist-pending ROOT [--shm-dir DIR] commit what a crashed process left in shared memory

Storage options go anywhere on the line: ``--storage-option key=value`` (repeatable, values parsed as
YAML), ``--config fastckpt.yaml`` (its ``storage_options`` and ``remote``), ``--storage-options JSON``.
Each command module is imported when it runs: ``--help`` never imports torch.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import NoReturn, Sequence

__all__ = ["main", "build_parser"]

def _common(parser: argparse.ArgumentParser, suffix: str, suppress: bool) -> None:
    """The storage options, on the top-level parser (``suffix=""``) and on each command (``"_sub"``, absent
    unless given): argparse lets a command's defaults overwrite the top level's, so they get their own names
    and ``_options`` merges them."""
    default = argparse.SUPPRESS if suppress else None
    group = parser.add_argument_group("storage options (accepted anywhere on the line)")
    group.add_argument("--storage-option", dest="storage_option" + suffix, action="append", metavar="KEY=VALUE",
                       default=default, help="an fsspec option; the value is parsed as YAML; dotted keys nest "
                       "(client_kwargs.endpoint_url=http://...); repeatable")
    group.add_argument("--storage-options", dest="storage_options" + suffix, type=json.loads, metavar="JSON",
                       default=default, help="fsspec options as one JSON object")
    group.add_argument("--config", dest="config" + suffix, metavar="YAML", default=default,
                       help="a fastckpt YAML: its storage_options and remote are used")
    group.add_argument("--remote", dest="remote" + suffix, metavar="URL", default=default,
                       help="the remote tier's URL (default: remote.url of --config)")


def _grace(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"--grace-s must be a number of seconds >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _step(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"--step must be an integer >= 0, got {text!r}")
    return int(text)


def _size(text: str) -> int:
    from .convert import parse_size

    return parse_size(text)


class _Parser(argparse.ArgumentParser):
    """argparse's errors quote what was typed: shown with control characters escaped, as every message is."""

    def error(self, message: str) -> NoReturn:
        from .text import clean

        super().error(clean(message))


def _command(sub: argparse._SubParsersAction, name: str, target: str, help: str) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help, description=help)
    _common(p, "_sub", suppress=True)
    p.set_defaults(target=target)
    return p


def _progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="bytes done so far on stderr (default: only when stderr is a terminal)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fastckpt", description="List, inspect, verify, convert and maintain "
                                     "fastckpt, Lightning, Accelerate and DCP checkpoints.")
    _common(parser, "", suppress=False)
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    p = _command(sub, "list", "listing:run", "one row per checkpoint under ROOT")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--json", action="store_true", help="print JSON rows")
    p = _command(sub, "inspect", "inspecting:run", "the state tree of one checkpoint (no tensor bytes read)")
    p.add_argument("path", metavar="CKPT")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = _command(sub, "verify", "verifying:run", "check every checksum; exit 1 if any checkpoint is bad")
    p.add_argument("paths", metavar="CKPT", nargs="+", help="a checkpoint, or a folder of them (a core root, a "
                   "Lightning dirpath, an Accelerate project): each checkpoint under it")
    _progress(p)
    p = _command(sub, "export", "convert:run_export", "write a checkpoint as a torch file or safetensors")
    p.add_argument("ckpt", metavar="CKPT")
    p.add_argument("out", metavar="OUT", help="a file (--to torch); a folder or a .safetensors file")
    p.add_argument("--to", choices=("torch", "safetensors"), required=True)
    p.add_argument("--key", help="the subtree to export, dotted (default for safetensors: Lightning state_dict, "
                   "Accelerate model, core model)")
    p.add_argument("--max-shard-size", type=_size, metavar="SIZE", help="shard safetensors (5GB, 500MiB)")
    _progress(p)
    p = _command(sub, "import", "convert:run_import", "save a foreign checkpoint into a core root")
    p.add_argument("src", metavar="IN", help="a torch.save file, a Lightning .ckpt, an Accelerate or DCP folder")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--step", type=_step, help="the step to save it at (default: the step it records: a .ckpt's "
                   "global_step, a manifest's step, an Accelerate folder's training step)")
    p.add_argument("--name", help="the checkpoint's name (default step-NNNNNNNNN)")
    _progress(p)
    p = _command(sub, "gc", "maintain:run_gc", "retention by hand, and folders of saves that died uncommitted")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--keep-last", type=_positive, metavar="N", help="keep the newest N committed checkpoints")
    p.add_argument("--keep-every", type=_positive, metavar="S", help="with --keep-last: also keep steps divisible by S")
    p.add_argument("--grace-s", type=_grace, default=3600.0,
                   help="uncommitted folders unchanged for this many seconds (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed; change nothing on disk (not even the root lock)")
    p = _command(sub, "persist-pending", "maintain:run_persist_pending",
                 "commit what a crashed process left staged in shared memory")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--shm-dir", help="the staging.shm_dir the crashed process used (default: the config's)")
    return parser


def _options(args: argparse.Namespace):  # -> CliOptions (imported lazily)
    from .options import load_options

    def pick(name: str):
        return getattr(args, name + "_sub", None) if hasattr(args, name + "_sub") else getattr(args, name)

    pairs = (getattr(args, "storage_option") or []) + (getattr(args, "storage_option_sub", None) or [])
    return load_options(pick("config"), pick("storage_options"), pairs, pick("remote"))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "gc" and args.keep_every is not None and args.keep_last is None:
        print("fastckpt: error: --keep-every needs --keep-last", file=sys.stderr)
        return 2
    from ..errors import FastCkptError

    try:
        module, fn = args.target.split(":")
        run = getattr(importlib.import_module(f".{module}", __name__), fn)
        return run(args, _options(args))
    except FastCkptError as e:
        from .text import clean

        print(f"fastckpt: error: {clean(' '.join(str(e).split()))}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `fastckpt list ROOT | head -1`: the reader left. Point stdout at /dev/null so the interpreter's
        # final flush does not raise again, and end quietly as git does.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
