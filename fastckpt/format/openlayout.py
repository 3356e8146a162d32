"""``OpenLayout``: the open layout (``layout.py``, docs/FORMAT.md) as a ``FileFormat``: how ``save()`` writes it.

Each staged shard becomes its own safetensors file as soon as it is copied (a header padded to 4 KiB, then the
staged bytes straight from the page-aligned slot, O_DIRECT where the storage allows it), so its buffer is free
again at once. The commit writes the pickled objects and the meta file (the tree and the tensor table), then
``manifest.json``: the commit point. Only then are the files of a checkpoint this one replaced removed.
"""
from __future__ import annotations

import json
import logging
from contextlib import nullcontext
from concurrent.futures import Executor
from typing import Any

from ..errors import FastCkptError, StorageError
from ..storage.local import aligned_buffer
from ..storage.protocol import Storage
from .checksum import combine, crc32c
from .clonewrite import write_cloned
from .contenthash import hash_records
from .layout import (
    MANIFEST, VERSION, CheckpointInfo, FileRecord, build_manifest, parse_manifest, shard_file_name, shard_header)
from .flatcache import tree_json
from .objectdedup import as_records, write_deduped
from .plan import Shard
from .protocol import ShardResult, Snapshot, StagedBytes

__all__ = ["OpenLayout", "OPEN_LAYOUT"]

log = logging.getLogger("fastckpt")


class OpenLayout:
    """Safetensors shards, a meta file and a manifest in ``root/name/``; stateless, so one instance serves all."""

    catalogued = True
    keeps_shards = False
    crc32c_per_tensor = True  # write_shard takes Snapshot.staged_crcs: the health pass may fill them (healthpass.py)

    def write_shard(self, storage: Storage, snap: Snapshot, shard: Shard, data: memoryview) -> ShardResult:
        """Called by an I/O worker: write the shard's file (header, then the staged bytes)."""
        header = shard_header(shard, snap.step, snap.keys)
        crc = crc32c(header)
        tensor_crcs = []
        data_crc = 0  # of the staged bytes alone (CRC32C of nothing is 0): a clone's check (clonewrite.py)
        staged = snap.staged_crcs.get(shard.index)  # computed once, when the bytes were staged
        with getattr(snap, "cpu_section", nullcontext)():  # reads every byte: one of the CPU-bound sections
            for i, e in enumerate(shard.entries):
                c = staged[i] if staged is not None else crc32c(data[e.offset: e.offset + e.nbytes])
                tensor_crcs.append(c)
                data_crc = combine(data_crc, c, e.nbytes)
            crc = combine(crc, data_crc, sum(e.nbytes for e in shard.entries))  # the header's, then the data's
            # content records for the next upload's dedup or clone, hashed here from the staged bytes (an I/O worker)
            hashes = (hash_records(header, data[: shard.nbytes], [e.offset for e in shard.entries])
                      if getattr(snap, "records", True) else None)
        name = shard_file_name(shard.index, snap.uid)
        head_mm, head = aligned_buffer(len(header))  # page-aligned so O_DIRECT can take it
        head[:] = header
        try:
            path = storage.join(snap.dirpath, name)
            # on an object store, the ranges the newest committed checkpoint holds are copied server-side; on a
            # local file system with reflinks, an unchanged shard is a clone of the newest checkpoint's
            source, recs = getattr(snap, "dedup", None), as_records(hashes or [])
            if not (write_deduped(storage, path, [head, data], recs, source)
                    or write_cloned(path, head, data[: shard.nbytes], data_crc, recs, source)):
                storage.write_file(path, [head, data])
        finally:
            head.release()
            head_mm.close()
        return shard.index, FileRecord(name, len(header) + shard.nbytes, crc, hashes), tensor_crcs

    def commit(self, storage: Storage, snap: Snapshot, results: list[ShardResult], staged: StagedBytes,
               pool: Executor) -> tuple[CheckpointInfo, int]:
        """Called by the committer: objects, meta, then the manifest (the commit); then the replaced files go."""
        files = sorted((r[1] for r in results), key=lambda f: f.name)
        crcs: dict[int, int] = {}
        header_len: dict[int, int] = {}
        by_shard = {s.index: s for s in snap.plan.shards}
        for index, rec, tcrcs in results:
            shard = by_shard[index]
            header_len[index] = rec.size - shard.nbytes  # the writer's header, not rebuilt here
            for e, c in zip(shard.entries, tcrcs):
                crcs[e.index] = c
        table = [
            {
                "key": snap.keys[e.index], "dtype": str(e.dtype).removeprefix("torch."), "shape": list(e.shape),
                "file": shard_file_name(e.shard, snap.uid), "offset": header_len[e.shard] + e.offset,
                "nbytes": e.nbytes, "crc32c": crcs[e.index], "numpy": snap.numpy[e.index],
                **({"device": snap.devices[e.index]} if snap.devices and snap.devices[e.index] != "cpu" else {}),
            }
            for e in snap.plan.entries
        ]
        wrote = 0
        if snap.objects is not None:
            obj_name = f"objects.{snap.uid}.pt"
            storage.write_file(storage.join(snap.dirpath, obj_name), [memoryview(snap.objects)])
            files.append(FileRecord(obj_name, len(snap.objects), crc32c(snap.objects)))
            wrote += len(snap.objects)
        doc: dict[str, Any] = {"tree": tree_json(snap.tree), "tensors": table,
                               "objects": f"objects.{snap.uid}.pt" if snap.objects is not None else None}
        if snap.dtensors:
            doc["dtensors"] = snap.dtensors
        meta = json.dumps(doc).encode()
        meta_name = f"meta.{snap.uid}.json"
        storage.write_file(storage.join(snap.dirpath, meta_name), [memoryview(meta)])
        files.append(FileRecord(meta_name, len(meta), crc32c(meta)))
        old = _listed_files(storage, snap.dirpath)
        nbytes = sum(f.size for f in files)
        health = snap.health_doc
        manifest = build_manifest(snap.name, snap.step, files, meta_name, nbytes,
                                  version=VERSION if snap.dtensors else 1, health=health)
        storage.write_atomic(storage.join(snap.dirpath, MANIFEST), manifest)  # <- the commit point
        for name in old - {f.name for f in files}:  # bytes of the checkpoint this one replaced
            try:
                storage.delete(storage.join(snap.dirpath, name))
            except StorageError as e:
                log.warning("fastckpt: could not remove replaced file %s: %s", name, e)
        return CheckpointInfo(snap.name, snap.step, snap.dirpath, nbytes,
                              healthy=None if health is None else health["healthy"]), wrote + len(meta)

    def discard(self, storage: Storage, snap: Snapshot) -> None:
        """Called by the committer after a failure: remove every file this save may have written (never another
        save's: names carry the uid), and the folder when that leaves it empty."""
        names = [shard_file_name(s.index, snap.uid) for s in snap.plan.shards]
        names += [f"meta.{snap.uid}.json", f"objects.{snap.uid}.pt"]
        try:
            for name in names:
                storage.delete(storage.join(snap.dirpath, name))
            if not storage.listdir(snap.dirpath):
                storage.delete_tree(snap.dirpath)
        except Exception as e:  # noqa: BLE001 - storage may be the thing that failed
            log.warning("fastckpt: could not remove partial files of %s: %s", snap.dirpath, e)


OPEN_LAYOUT = OpenLayout()


def _listed_files(storage: Storage, dirpath: str) -> set[str]:
    """The files the manifest already under ``dirpath`` lists (a checkpoint this save replaces), if any."""
    try:
        data = storage.read_bytes(storage.join(dirpath, MANIFEST))
    except FileNotFoundError:
        return set()
    try:
        return set(parse_manifest(data, dirpath)["files"])
    except FastCkptError:
        return set()
