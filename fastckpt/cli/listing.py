"""``fastckpt list ROOT``: one row per checkpoint under a core root, a Lightning dirpath or an
Accelerate ``checkpoints/`` folder.

Rows are read cheaply, without importing torch: core manifests, Lightning file names (``step=N``) or, failing
that, the torch file's pickle only (``format.picklepeek``; torch's own safe loader only for a pickle naming other
classes), Accelerate folder names and their optimizer's step count (``layout.accelerate_step``). Status says what a
user must know before resuming: ``committed``, ``pending upload`` (committed here, not yet on the
remote tier), ``torn`` (a truncated zip file), ``foreign`` (a torch-named file that is no checkpoint
``torch.load(weights_only=True)`` reads: a whole pickled module, an unrelated ``.bin``) or
``uncommitted`` (a save that never committed: gc's). A Lightning dirpath may hold sharded checkpoints,
folders named like files (``epoch=0-step=10.ckpt/``): fastckpt's (a core checkpoint, layout
``lightning-sharded``) or stock Lightning's (a DCP folder, layout ``lightning-dcp``). Entries that are
neither regular files nor folders (a FIFO, a dangling link) are never opened.
"""
from __future__ import annotations

import argparse
import os
import re
import stat
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import FastCkptError, IntegrityError
from ..format.healthrecord import file_health, verdict
from ..format.manifest import MANIFEST, parse_manifest
from ..tiers.catalog import Catalog
from ..tiers.gc import is_save_folder
from .. import LocalStorage
from ..format.picklepeek import peek
from .layout import (ACCELERATE_FILE, FileView, Located, accelerate_step, children, has_zip_end, is_torch_name,
                     is_zip_start, locate, pointer_parts, pointer_step, read_skeleton)
from .options import CliOptions, is_remote, print_json
from .text import clean, human_size, table

__all__ = ["Row", "list_root", "run"]

_STEP = re.compile(r"(?:^|[-_])step=(\d+)")
_EPOCH = re.compile(r"(?:^|[-_])epoch=(\d+)")
_ACC_FOLDER = re.compile(r"checkpoint_(\d+)")


@dataclass(slots=True)
class Row:
    """One checkpoint as ``list`` shows it (``--json`` prints these fields)."""

    name: str
    step: int | None
    epoch: int | None
    created: float | None
    nbytes: int
    where: str
    status: str
    path: str
    layout: str
    problem: str | None = None
    """What a ``damaged`` checkpoint lacks (a folder deleted part way keeps its manifest); else None."""
    health: str = "-"
    """``ok`` (no NaN or Inf), ``NaN=n Inf=m`` (diverged: not one to resume), ``unknown`` (a record that
    contradicts itself: ``verdict``) or ``-`` (never measured), from its manifest or, for a Lightning file, its
    extended attribute (a sidecar on an object store; fastckpt/format/health.py)."""

    @property
    def healthy(self) -> bool | None:
        """The health verdict, as retention (``doomed``) reads it: gc never removes the newest healthy file."""
        return None if self.health in ("-", "unknown") else self.health == "ok"


def list_root(root: str, opts: CliOptions) -> list[Row]:
    """The rows under ``root``, oldest step first; a missing root raises ``CheckpointNotFoundError``."""
    loc = locate(root, opts.storage_options)
    names = children(loc)
    if names is None:
        raise IntegrityError(f"{root} is a file; `fastckpt list` takes a folder (`fastckpt inspect` a file)")
    if "checkpoints" in names and not any(_ACC_FOLDER.fullmatch(n) for n in names):
        loc = Located(loc.storage, loc.storage.join(loc.path, "checkpoints"))  # an Accelerate project_dir
        names = children(loc) or []
    here = _where(loc.path)
    if any(is_torch_name(n) for n in names):
        rows = [row for n in names if is_torch_name(n)
                for row in [_lightning_entry(Located(loc.storage, loc.storage.join(loc.path, n)), here)] if row]
    elif any(_ACC_FOLDER.fullmatch(n) for n in names):
        rows = [_accelerate_row(Located(loc.storage, loc.storage.join(loc.path, n)), here) for n in names
                if _ACC_FOLDER.fullmatch(n)]
    else:
        rows = _core_rows(loc, names, here, opts)
    return sorted(rows, key=_order)


def _order(row: Row) -> tuple[int, str]:
    """Oldest first: by step; Accelerate folders by their index, the order they were saved in (the step Accelerate
    records restarts at 0 at the end of each prepared dataloader, so it orders saves only within one epoch)."""
    index = _ACC_FOLDER.fullmatch(row.name) if row.layout == "accelerate" else None
    if index is not None:
        return int(index.group(1)), row.name
    return (row.step if row.step is not None else -1), row.name


def _core_rows(loc: Located, names: list[str], here: str, opts: CliOptions) -> list[Row]:
    rows = {}
    for name in names:
        if name.startswith("."):
            continue
        row = _core_row(Located(loc.storage, loc.storage.join(loc.path, name)), here)
        if row is not None:
            rows[name] = row
    if opts.remote_url is None:
        return list(rows.values())
    remote = locate(opts.remote_url, opts.remote_options)
    for name in children(remote) if _exists(remote) else []:
        row = _core_row(Located(remote.storage, remote.storage.join(remote.path, name)), "remote")
        if row is None or row.status not in ("committed", "damaged"):
            continue
        mine = rows.get(name)
        if mine is None:
            rows[name] = row  # only there (a damaged remote copy too: a resume from there would fail)
        elif mine.status == row.status == "committed":
            mine.where = "both"
    for row in rows.values():
        if row.where == here and row.status == "committed":
            row.status = "pending upload"  # committed here but not (yet) on the remote tier
    return list(rows.values())


def _exists(loc: Located) -> bool:
    try:
        return children(loc) is not None
    except FastCkptError:
        return False


def _where(path: str) -> str:
    """``local``, or the URL scheme of a remote root (``s3``, ``gs``): where the root's own rows live."""
    return path.split("://", 1)[0] if is_remote(path) else "local"


def _core_row(loc: Located, where: str) -> Row | None:
    """A core checkpoint folder's row; None for anything that is not a save's folder."""
    storage = loc.storage
    try:
        files = storage.listdir(loc.path)
    except (FastCkptError, OSError):
        return None
    if MANIFEST not in files:
        if not files or not is_save_folder(files):
            return None
        size = sum(_file_size(loc, f) for f in files)
        step = re.fullmatch(r"step-(\d+)", loc.name)
        return Row(loc.name, int(step.group(1)) if step else None, None, _mtime(loc, files), size, where,
                   "uncommitted", loc.path, "core")
    mpath = storage.join(loc.path, MANIFEST)
    try:
        doc = parse_manifest(storage.read_bytes(mpath), mpath)
    except FastCkptError as e:
        print(f"fastckpt: warning: {clean(e)}", file=sys.stderr)
        return Row(loc.name, None, None, None, 0, where, "torn", loc.path, "core")
    created = doc.get("created")
    row = Row(loc.name, doc["step"], None, created if isinstance(created, (int, float)) else None,
              doc.get("nbytes", 0), where, "committed", loc.path, "core")
    meta = (doc.get("user") or {}).get("fastckpt_accelerate")  # fastckpt_accelerate's: the training step
    if isinstance(meta, dict) and type(meta.get("step")) is int:
        row.step = meta["step"]
    row.health = _health_cell(doc.get("health"))
    row.problem = Catalog.damage_of(storage, loc.path, doc, files)
    if row.problem is not None:
        row.status = "damaged"  # committed, then deleted part way (or copied part way): it does not load
    return row


def _lightning_entry(loc: Located, where: str) -> Row | None:
    """The row of a torch-named entry of a Lightning dirpath: a file, a sharded checkpoint folder, or None."""
    kind = _entry_kind(loc)
    if kind == "file":
        return _lightning_row(loc, where)
    if kind != "dir":
        return None  # a FIFO, a socket, a dangling link: never opened (a FIFO would block the read)
    files = children(loc) or []
    if MANIFEST in files or is_save_folder(files):  # FastModelParallelStrategy's: a core checkpoint
        row = _core_row(loc, where)
        if row is not None:
            row.layout = "lightning-sharded"
        return row
    if ".metadata" in files:  # stock Lightning's sharded checkpoint (torch.distributed.checkpoint)
        step = _STEP.search(loc.name)
        epoch = _EPOCH.search(loc.name)
        return Row(loc.name, int(step.group(1)) if step else None, int(epoch.group(1)) if epoch else None,
                   _mtime(loc, files), sum(_file_size(loc, f) for f in files), where, "committed", loc.path, "lightning-dcp")
    return None  # a folder that is no checkpoint


def _entry_kind(loc: Located) -> str:
    """``file``, ``dir`` or ``other`` (what a local symlink points to; every object of a store is a file)."""
    if not isinstance(loc.storage, LocalStorage):
        return "file" if children(loc) is None else "dir"
    try:
        mode = os.stat(loc.path).st_mode
    except OSError:
        return "other"
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "other"


def _file_size(loc: Located, name: str) -> int:
    try:
        return loc.storage.size(loc.storage.join(loc.path, name))
    except (FastCkptError, OSError):
        return 0


def _lightning_row(loc: Located, where: str) -> Row:
    step = _STEP.search(loc.name)
    epoch = _EPOCH.search(loc.name)
    row = Row(loc.name, int(step.group(1)) if step else None, int(epoch.group(1)) if epoch else None,
              _modified(loc), loc.storage.size(loc.path), where, "committed", loc.path, "lightning")
    try:
        row.health = _health_cell(file_health(loc.storage, loc.path))
    except (FastCkptError, OSError) as e:  # a crafted record: said, and the file listed all the same
        print(f"fastckpt: warning: {clean(e)}", file=sys.stderr)
    try:
        if pointer_parts(loc) is not None:  # fastckpt 0.1's layout
            row.layout, row.step = "lightning-0.1-pointer", pointer_step(loc)
            return row
    except FastCkptError:
        pass
    if not has_zip_end(loc) and is_zip_start(loc):
        row.status = "torn"  # a zip without its end record: the write stopped part way
        return row
    if row.step is None or row.epoch is None or not has_zip_end(loc):
        try:
            skeleton = _skeleton(loc)  # the pickle only: no tensor bytes are read
        except FastCkptError:
            row.status = "foreign"  # torch's safe loader refuses it: not a checkpoint to resume, nor fastckpt's
            return row
        if isinstance(skeleton, dict):
            row.step = skeleton.get("global_step", row.step)
            row.epoch = skeleton.get("epoch", row.epoch)
    return row


def _skeleton(loc: Located) -> Any:
    """A torch file's object tree, read without torch where its pickle names only what torch's safe loader allows by
    default; otherwise torch's own ``weights_only`` loader decides (and refuses a foreign file)."""
    try:
        peeked = peek(FileView(loc), loc.path)
    except FastCkptError:
        peeked = None  # an old raw-pickle file, or damage: torch's reader says which
    return peeked.tree if peeked is not None and peeked.plain else read_skeleton(loc)


def _accelerate_row(loc: Located, where: str) -> Row:
    files = (children(loc) or []) if _entry_kind(loc) == "dir" else []
    stock = any(ACCELERATE_FILE.fullmatch(f) for f in files)
    if MANIFEST in files:  # written by fastckpt_accelerate
        row = _core_row(loc, where)
        assert row is not None
        row.layout = "accelerate"
        if stock and row.status != "torn":  # its native folders: the optimizer's count, as for stock's
            row.step = accelerate_step(loc)
        return row  # its older core layout: the manifest's step
    size = sum(_file_size(loc, f) for f in files)
    status = "committed" if stock else "uncommitted"
    step = accelerate_step(loc) if status == "committed" else None
    row = Row(loc.name, step, None, _mtime(loc, files), size, where, status, loc.path, "accelerate")
    if status == "committed":  # stock save_state writes the model first and the RNG states last: both, or damaged
        lacks = [what for what, there in (("the model file", any(f.startswith(("model", "pytorch_model"))
                                                                 for f in files)),
                                          ("random_states_0.pkl", "random_states_0.pkl" in files)) if not there]
        if lacks:
            row.status, row.problem = "damaged", f"{' and '.join(lacks)} missing"
    return row


def _modified(loc: Located) -> float | None:
    modified = getattr(loc.storage, "modified", None)
    try:
        return modified(loc.path) if modified is not None else None
    except (FastCkptError, OSError):
        return None


def _mtime(loc: Located, files: list[str]) -> float | None:
    times = [_modified(Located(loc.storage, loc.storage.join(loc.path, f))) for f in files]
    return max((t for t in times if t is not None), default=None)


def run(args: argparse.Namespace, opts: CliOptions) -> int:
    rows = list_root(args.root, opts)
    if args.json:
        print_json([asdict(r) for r in rows])
        return 0
    if not rows:
        print(f"no checkpoints under {clean(args.root)}", file=sys.stderr)
        return 0
    cells = [(_dash(r.step), _dash(r.epoch), _when(r.created), human_size(r.nbytes), r.where, r.status, r.health,
              r.name) for r in rows]
    print("\n".join(table(("STEP", "EPOCH", "COMMITTED", "SIZE", "WHERE", "STATUS", "HEALTH", "NAME"), cells,
                          right=(0, 1, 3))))
    for r in rows:
        if r.problem is not None:  # the table says damaged; this says why, and what to do
            print(clean(f"fastckpt: warning: {r.name} is damaged: {r.problem}; it does not load. `fastckpt verify "
                        f"{r.path}` checks every file; remove it once you have what you need from it"), file=sys.stderr)
    return 0


def _health_cell(health: dict[str, Any] | None) -> str:
    if health is None:
        return "-"
    believed = verdict(health)
    if believed is None:  # a record that contradicts itself (incomplete, or rows counting NaN/Inf): not "ok"
        return "unknown"
    return "ok" if believed else f"NaN={health.get('nan', 0)} Inf={health.get('inf', 0)}"


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
