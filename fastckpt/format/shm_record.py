"""The ``staged.json`` record of the shared-memory tier: what it holds, and its validation.

A record describes one fully staged, uncommitted snapshot: its name, step and uid, the
plan (which tensor sits at which offset of which shard buffer), the shards this rank
staged, and the CRC32C of every staged tensor, computed right after the copy. The next
process rebuilds the checkpoint from it, so everything in it is hostile until checked:
names go through ``fastckpt.format.paths``, numbers are typed and bounded, the layout must fit
the buffers, and the checkpoint directory is recomputed from the root, never taken
from the record.
"""
from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import IntegrityError
from .flatcache import tree_json
from .layout import shard_file_name
from .paths import confine, plain_name
from .plan import Plan, Shard, TensorEntry

__all__ = ["RECORD", "COMMITTED", "RECORD_VERSION", "StagedRecord", "encode_record", "decode_record"]

RECORD = "staged.json"
# The record renamed once its snapshot committed: the buffers then hold a committed checkpoint that a restarted
# process may load from memory (fastckpt.tiers.shm_load), until the slot is taken for the next snapshot.
COMMITTED = "committed.json"
RECORD_VERSION = 1


@dataclass
class StagedRecord:
    """A staged, uncommitted snapshot found in shared memory, validated."""

    dir: str  # the slot folder holding the record and the shard buffers
    owner: str
    rank: int
    world: int
    name: str
    step: int
    uid: str
    dirpath: str  # recomputed from the root and ``name``
    tree: Any
    objects: bytes | None
    keys: list[str]
    numpy: list[bool]
    plan: Plan
    crcs: dict[int, list[int]]  # per staged shard: each entry's CRC32C, in ``shard.entries`` order
    dtensors: list[dict[str, Any]]

    @property
    def label(self) -> str:
        return f"checkpoint {self.name!r} (step {self.step}, uid {self.uid})"


def encode_record(job: Any, owner: str, rank: int, world: int) -> bytes:
    """The record of a fully staged ``job`` (called by the thread that finished staging it)."""
    plan: Plan = job.plan
    doc = {
        "version": RECORD_VERSION, "owner": owner, "rank": rank, "world": world,
        "name": job.handle.name, "step": job.handle.step, "uid": job.uid, "dirpath": job.dirpath,
        "tree": tree_json(job.tree), "numpy": job.numpy, "keys": job.keys,
        "objects": base64.b64encode(job.objects).decode() if job.objects is not None else None,
        "entries": [[str(e.dtype).removeprefix("torch."), list(e.shape), e.nbytes, e.lazy, e.shard, e.offset]
                    for e in plan.entries],
        "shards": [[s.index, s.nbytes, s.lazy] for s in plan.shards],
        "owned": sorted(plan.owned) if plan.owned is not None else None,
        "crcs": {str(i): c for i, c in job.staged_crcs.items()},
        "dtensors": job.dtensors,
    }
    return json.dumps(doc).encode()


def decode_record(data: bytes, slot_dir: str, source: str, *, root: str, join: Any, owner: str, rank: int,
                  world: int) -> StagedRecord:
    """Parse and validate a record read from ``source``; raise ``IntegrityError`` (or its
    ``UnsafeCheckpointError`` subclass) naming the field that is wrong."""
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{source}: not valid JSON ({e})") from e
    _check(isinstance(doc, dict) and doc.get("version") == RECORD_VERSION, source, "version",
           f"a record of version {RECORD_VERSION}")
    _check(doc.get("owner") == owner, source, "owner", f"{owner!r}, the folder it lies in (was it copied?)")
    _check(doc.get("rank") == rank and doc.get("world") == world, source, "rank/world",
           f"rank {rank} of {world}, this process's place")
    name = plain_name(doc.get("name"), "checkpoint", source)
    uid = plain_name(doc.get("uid"), "uid", source)
    for shard_no in range(len(doc.get("shards") or [])):
        plain_name(shard_file_name(shard_no, uid), "shard file", source)
    dirpath = confine(root, join(root, name), f"{source}: checkpoint folder")
    _check(doc.get("dirpath") == dirpath, source, "dirpath", f"{dirpath!r} (the root joined with the name)")
    step = doc.get("step")
    _check(_is_int(step) and step >= 0, source, "step", "a non-negative integer")
    plan, owned = _plan(doc, source, slot_dir)
    entries = len(plan.entries)
    keys, numpy = doc.get("keys"), doc.get("numpy")
    _check(isinstance(keys, list) and len(keys) == entries and all(isinstance(k, str) for k in keys), source,
           "keys", "one string per tensor entry")
    _check(isinstance(numpy, list) and len(numpy) == entries and all(isinstance(b, bool) for b in numpy),
           source, "numpy", "one boolean per tensor entry")
    _check_tree(doc.get("tree"), entries, source)
    dtensors = doc.get("dtensors") or []
    _check(isinstance(dtensors, list) and all(isinstance(d, dict) for d in dtensors), source, "dtensors",
           "a list of objects")
    return StagedRecord(slot_dir, owner, rank, world, name, step, uid, dirpath, doc.get("tree"),
                        _objects(doc.get("objects"), source), keys, numpy, plan, _crcs(doc, plan, owned, source),
                        dtensors)


def _plan(doc: dict[str, Any], source: str, slot_dir: str) -> tuple[Plan, set[int] | None]:
    raw_shards = doc.get("shards")
    _check(isinstance(raw_shards, list), source, "shards", "a list")
    shards = []
    for i, s in enumerate(raw_shards):
        _check(isinstance(s, list) and len(s) == 3 and s[0] == i and _is_int(s[1]) and s[1] >= 0
               and isinstance(s[2], bool), source, f"shards[{i}]", f"[{i}, nbytes, lazy]")
        shards.append(Shard(index=i, nbytes=s[1], lazy=s[2]))
    raw_entries = doc.get("entries")
    _check(isinstance(raw_entries, list), source, "entries", "a list")
    entries = [_entry(i, e, shards, source) for i, e in enumerate(raw_entries)]
    for e in entries:
        shards[e.shard].entries.append(e)
    for s in shards:
        # the planner's order (by offset; a zero-size tensor before its neighbour), which the checksums follow
        s.entries.sort(key=lambda e: (e.offset, -e.dtype.itemsize, e.index))
        for a, b in zip(s.entries, s.entries[1:]):
            _check(a.offset + a.nbytes <= b.offset, source, f"entries[{b.index}]", "no overlap with another tensor")
        # The planner packs a shard's tensors with no hole, so its size is exactly theirs: a larger claim would
        # have recovery allocate, checksum-skip and write bytes no tensor covers (a sparse buffer of any size).
        _check(s.nbytes == sum(e.nbytes for e in s.entries), source, f"shards[{s.index}]",
               f"sized by its tensors ({sum(e.nbytes for e in s.entries)} bytes, not {s.nbytes})")
    owned = doc.get("owned")
    _check(owned is None or (isinstance(owned, list) and all(_is_int(i) and 0 <= i < len(shards) for i in owned)),
           source, "owned", "null or a list of shard indices")
    plan = Plan(key=("recovered", slot_dir), entries=entries, shards=shards,
                total_bytes=sum(s.nbytes for s in shards), owned=set(owned) if owned is not None else None)
    return plan, plan.owned


def _entry(i: int, raw: Any, shards: list[Shard], source: str) -> TensorEntry:
    field = f"entries[{i}]"
    _check(isinstance(raw, list) and len(raw) == 6, source, field, "[dtype, shape, nbytes, lazy, shard, offset]")
    dt, shape, nbytes, lazy, shard, offset = raw
    dtype = getattr(torch, dt, None) if isinstance(dt, str) else None
    _check(isinstance(dtype, torch.dtype), source, f"{field} dtype", "a torch dtype name")
    _check(isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape), source, f"{field} shape",
           "a list of non-negative integers")
    _check(_is_int(nbytes) and nbytes == math.prod(shape) * dtype.itemsize, source, f"{field} nbytes",
           "the shape's element count times the dtype's size")
    _check(isinstance(lazy, bool), source, f"{field} lazy", "a boolean")
    _check(_is_int(shard) and 0 <= shard < len(shards), source, f"{field} shard", "a shard index")
    _check(_is_int(offset) and offset >= 0 and offset + nbytes <= shards[shard].nbytes, source, f"{field} offset",
           "an offset that keeps the tensor inside its shard")
    return TensorEntry(i, dtype, tuple(shape), nbytes, lazy, shard, offset)


def _crcs(doc: dict[str, Any], plan: Plan, owned: set[int] | None, source: str) -> dict[int, list[int]]:
    raw = doc.get("crcs")
    _check(isinstance(raw, dict), source, "crcs", "an object")
    staged = plan.mine(plan.shards)
    _check(sorted(raw) == sorted(str(s.index) for s in staged), source, "crcs",
           "one list per staged shard (the checksums of the bytes that were staged)")
    out = {}
    for s in staged:
        values = raw[str(s.index)]
        _check(isinstance(values, list) and len(values) == len(s.entries)
               and all(_is_int(c) and 0 <= c < 2**32 for c in values), source, f"crcs[{s.index}]",
               "one CRC32C per tensor of the shard")
        out[s.index] = values
    return out


def _check_tree(tree: Any, entries: int, source: str) -> None:
    """Every tensor reference ``{"T": i}`` of the tree is an int in ``range(entries)`` (Python would read -1 as the
    last tensor), checked before the snapshot is committed; walked iteratively, so depth cannot break it."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "T" in node:
                ref = node["T"]
                _check(type(ref) is int and 0 <= ref < entries, source, "tree",
                       f"a tree whose tensor references lie in [0, {entries}) (found {ref!r:.40})")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _objects(raw: Any, source: str) -> bytes | None:
    if raw is None:
        return None
    _check(isinstance(raw, str), source, "objects", "null or base64 text")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as e:
        raise IntegrityError(f"{source}: the 'objects' field is not valid base64 ({e})") from e


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(ok: bool, source: str, field: str, expected: str) -> None:
    if not ok:
        raise IntegrityError(f"{source}: the {field!r} field is not {expected}; the record is damaged or was "
                             "planted, so it is not recovered")
