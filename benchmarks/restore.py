"""The "restore" section (issue 13): how long a resume waits, and how much memory it takes, per loader.

One task saves the same training state (the workload model + AdamW after one step) with every loader's
own saver: ``torch.save``, DCP, fastckpt on the local disk, fastckpt staged in shared memory by a process
that then dies (``os._exit`` right after the commit: what a crash leaves), fastckpt on S3 (SeaweedFS on
loopback, when ``weed`` is installed) and the peers that are installed. Then every load runs in a fresh
process of its own, cold (the files' pages dropped from the page cache, as the io section does) and warm:
the wall time of the load call and the peak RSS above what the process held before it (VmHWM reset
through /proc/self/clear_refs; the template a loader fills in place is allocated before, as a model is).
After the bit-exact check, "first write": the time to write one byte of every 4 KiB page of the loaded
CPU tensors (bits unchanged), what the first optimizer step pays on top of the load. A loader that maps
the file (``mmap=True``-style zero copy) defers its page copies (copy-on-write) to that moment; one that
returns private memory pays nothing there. Without it, a mapped load's time understates the resume.

The S3 figures come with the bandwidth of N concurrent whole-object s3fs GETs of the same shards, the
reference of the "remote" target.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from . import peers as peers_mod
from . import workload as wl
from .measure import Trainer, drop_cache, first_difference, reset_hwm, rss, tree_bytes, vm_hwm, warm_cache, \
    zeroed_like

# loader -> (label, the folder or file it reads, whether it fills a template in place)
LOADERS: dict[str, tuple[str, str, bool]] = {
    "torch_load": ("torch.load", "torch.pt", False),
    "dcp_load": ("DCP load (in place)", "dcp", True),
    "torchzip": ("fastckpt.read.torchzip (the same torch file)", "torch.pt", False),
    "fastckpt_load": ("fastckpt load(), local", "fc", False),
    "fastckpt_load_into": ("fastckpt load_into(), local", "fc", True),
    "fastckpt_shm": ("fastckpt load(), shm tier", "fc_shm", False),
    "fastckpt_shm_into": ("fastckpt load_into(), shm tier", "fc_shm", True),
    "fastckpt_s3": ("fastckpt load(), S3", "", False),
    "fastckpt_s3_into": ("fastckpt load_into(), S3", "", True),
}
_SKIP_PEERS = ("torch_save", "dcp_default", "dcp_stager", "fastckpt", "lightning_async")  # measured above


def _state(shape: dict, flat: int = 0) -> tuple[Trainer | None, dict]:
    if flat:  # the cold-load case of issue 27: ``flat`` tensors of 4 MiB (restore_cold.py)
        from .restore_cold import flat_state

        return None, flat_state(flat)
    tr = Trainer(wl.Shape(**shape))
    tr.step()  # AdamW's state exists after one step, as at any resume
    return tr, tr.state(1)


def _fc(root: str, **kw: Any) -> Any:
    from fastckpt import CheckpointConfig, Checkpointer

    return Checkpointer(CheckpointConfig(root=root, **kw))


def _shm_cfg(shm_dir: str) -> dict[str, Any]:
    return {"staging": {"shm": True, "shm_dir": shm_dir}}


def _die_after_shm_save(root: str, shm_dir: str, state: dict) -> None:
    ck = _fc(root, **_shm_cfg(shm_dir))
    ck.save(state, 1).wait()
    os._exit(0)  # no close(): the committed snapshot stays in shared memory, as after a crash


def task_restore_shm_save(shape: dict, root: str, shm_dir: str) -> dict[str, Any]:
    """A process that commits the state with shm staging and dies: its snapshot stays in shared memory."""
    _, state = _state(shape)
    shutil.rmtree(Path(root) / "fc_shm", ignore_errors=True)
    child = mp.get_context("fork").Process(target=_die_after_shm_save, args=(str(Path(root) / "fc_shm"), shm_dir,
                                                                             state))
    child.start()
    child.join()
    return {"exitcode": child.exitcode}


def task_restore_save(shape: dict, root: str, shm_dir: str, s3: dict | None, peers: list[str]) -> dict[str, Any]:
    """Save the state once per loader; returns the state's size and which saves exist."""
    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    _, state = _state(shape)
    torch.save(state, r / "torch.pt")
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(r / "dcp"), no_dist=True)
    with _fc(str(r / "fc")) as ck:
        ck.save(state, 1).wait()
    out: dict[str, Any] = {"state_bytes": sum(t.numel() * t.element_size() for t in _tensors(state)), "peers": []}
    if s3 is not None:
        with _fc(s3["url"], storage_options=s3["storage_options"]) as ck:
            ck.save(state, 1).wait()
    for name in peers:
        if name in _SKIP_PEERS or peers_mod.PEERS[name].missing():
            continue
        p = peers_mod.make(name, r / f"peer_{name}")
        p.save(state, 1)
        p.close()
        out["peers"].append(name)
    os.sync()
    return out


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _loader(loader: str, root: Path, shm_dir: str, s3: dict | None, template: Any) -> tuple[Callable[[], Any], Any]:
    """The load call to time, and what to close afterwards."""
    if loader == "torch_load":
        return lambda: torch.load(root / "torch.pt", map_location="cpu", weights_only=True), None
    if loader == "torchzip":
        from fastckpt.read.torchzip import load_torch_file

        return lambda: load_torch_file(str(root / "torch.pt")), None
    if loader == "dcp_load":
        import torch.distributed.checkpoint as dcp

        return lambda: (dcp.load(template, checkpoint_id=str(root / "dcp"), no_dist=True), template)[1], None
    if loader.startswith("peer_"):
        p = peers_mod.make(loader[5:], root / loader)
        return lambda: p.load(1, template), p
    if loader.startswith("fastckpt_s3"):
        assert s3 is not None
        ck = _fc(s3["url"], storage_options=s3["storage_options"])
    elif loader.startswith("fastckpt_shm"):
        ck = _fc(str(root / "fc_shm"), **_shm_cfg(shm_dir))
    else:
        ck = _fc(str(root / "fc"))
    if loader.endswith("_into"):
        return lambda: ck.load_into(template), ck
    return lambda: ck.load(), ck


def task_restore_load(shape: dict, root: str, loader: str, cold: bool, shm_dir: str = "/dev/shm",
                      s3: dict | None = None, check: bool = True, flat: int = 0) -> dict[str, Any]:
    """One timed load in this (fresh) process: seconds, peak RSS above the start, the tier that served it."""
    r = Path(root)
    in_place = LOADERS.get(loader, ("", "", True))[2]
    # The state to compare with is rebuilt after the timed load: holding a second copy during it would make
    # this process unlike a restarted trainer (its fresh allocations would come from memory no process had
    # touched, slower to fault in on this VM than the memory the reference copies use).
    template = zeroed_like(_state(shape, flat)[1]) if in_place else None
    gc.collect()
    call, closer = _loader(loader, r, shm_dir, s3, template)
    folder = LOADERS.get(loader, ("", loader, False))[1]
    if folder:
        (drop_cache if cold else warm_cache)(r / folder)
    base = rss()
    hwm_ok = reset_hwm()
    t0 = time.perf_counter()
    got = call()
    seconds = time.perf_counter() - t0
    peak = (vm_hwm() or 0) - base if hwm_ok else None
    out: dict[str, Any] = {"loader": loader, "cold": cold, "seconds": seconds, "peak_rss_above_bytes": peak,
                           "bytes_on_disk": tree_bytes(r / folder) if folder else None}
    stats = getattr(closer, "last_load_stats", None)
    if stats is not None:
        out.update(tier=stats.tier, method=stats.method, nbytes=stats.nbytes, verified=stats.verified)
    out["strategy"] = _verdict(r / folder, loader) if folder and loader.startswith("fastckpt") else None
    if template is not None:
        out["dest_bytes_by_page_offset"] = _page_offsets(template)
    if check:
        diff = first_difference(_state(shape, flat)[1], got)
        out["bit_exact"] = diff is None
        if diff:
            out["diff"] = diff
    out["first_write_s"] = _first_write(got)
    if closer is not None:
        closer.close()
    return out


def _page_offsets(obj: Any) -> dict[str, int]:
    """Bytes of the CPU tensors of 1 MiB or more in ``obj`` by their address modulo 4096: where an in-place load
    writes decides which raw reader is its ceiling (O_DIRECT reads only into page-aligned memory)."""
    out: dict[str, int] = {}
    for t in _tensors(obj):
        if t.device.type == "cpu" and t.numel() * t.element_size() >= 1 << 20:
            key = str(t.data_ptr() % 4096)
            out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def _verdict(where: Path, loader: str) -> list[str] | None:
    """The read strategy chosen on this device for ``loader``'s kind of load (``read.strategy: auto``: a cold
    load's probe, or ``load_into``'s trial), from the verdict file a Checkpointer keeps in its root
    (docs/FORMAT.md)."""
    import json

    try:
        return [json.loads((where / ".fastckpt-read.json").read_text())["into" if loader.endswith("_into")
                                                                         else "strategy"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _first_write(obj: Any) -> float:
    """Seconds to write one byte of every 4 KiB page of the CPU tensors in ``obj``, leaving every bit as it was."""
    t0 = time.perf_counter()
    for t in _tensors(obj):
        if t.device.type == "cpu" and t.is_contiguous() and t.numel() * t.element_size() >= 4096:
            t.detach().reshape(-1).view(torch.uint8)[::4096].add_(0)  # uint8 + 0: exact
    return time.perf_counter() - t0


def task_restore_s3_whole(s3: dict) -> dict[str, Any]:
    """The reference: the checkpoint's shard objects fetched whole by concurrent s3fs GETs (``fs.cat``)."""
    import fsspec

    fs = fsspec.filesystem("s3", **s3["storage_options"])
    paths = [p for p in fs.find(s3["url"].removeprefix("s3://")) if p.endswith(".safetensors")]
    t0 = time.perf_counter()
    data = fs.cat(paths)
    seconds = time.perf_counter() - t0
    nbytes = sum(len(v) for v in data.values())
    return {"objects": len(paths), "bytes": nbytes, "seconds": seconds, "GBps": nbytes / seconds / 1e9}


def task_restore_raw_read(root: str, kind: str, reader: str | None = None, reps: int = 1, shape: dict | None = None,
                          flat: int = 0) -> dict[str, Any]:
    """One part of the device's ceiling for a cold load (benchmarks/rawread.py): ``reader`` (else each raw reader)
    of ``kind``'s files into ``kind``'s memory (``RAW_KINDS``), ``{"kind", **raw_read(...)}``. The cold-load rounds
    run each reader in a process of its own, placed among the loaders' (restore_cold.py says why).

    Into faulted-in memory (the ceiling of ``load_into``), with ``shape``: the process first does what
    ``load_into``'s does before its clock (``task_restore_load``: the state built, a zeroed copy of it kept as the
    model to fill), so that the reader and the loader start from the same memory. Without it the reader started
    lighter: in one window, 8 rounds in turns on the benchmark VM (2026-11-29, 1.48 GB), raw ``parallel`` into
    memory past a page read in 1.129 s median (best 1.006) in a bare process and in 1.194 s (best 1.119) after the
    same steps as ``load_into``, whose own median was 1.101 s (best 1.021)."""
    from .rawread import RAW_KINDS, READERS, raw_read, shard_files

    where, fresh, offset = RAW_KINDS[kind]
    model = zeroed_like(_state(shape, flat)[1]) if shape is not None and not fresh else None
    gc.collect()
    files = shard_files(Path(root) / where) if where == "fc" else [str(Path(root) / where)]
    out = {"kind": kind, **raw_read(files, reps, fresh=fresh, offset=offset, readers=(reader,) if reader else READERS)}
    del model  # alive through the reads, as load_into's model is
    return out


def _fill_shm(path: str, nbytes: int) -> None:
    import mmap as _mmap

    with open(path, "wb") as f:
        f.truncate(nbytes)
    with open(path, "r+b") as f:
        mm = _mmap.mmap(f.fileno(), nbytes)
    torch.frombuffer(mm, dtype=torch.uint8).fill_(7)
    mm.close()


def task_restore_memcpy(nbytes: int, shm_dir: str) -> dict[str, Any]:
    """The reference of the shm tier: copying ``nbytes`` out of a shared-memory file that another process wrote
    (as a crashed trainer did), into fresh memory (what ``load()`` must do) and into memory already faulted in
    (what ``load_into()`` does), with torch's copy and no checksum."""
    import mmap as _mmap

    path = os.path.join(shm_dir, "memcpy-reference.bin")
    child = mp.get_context("fork").Process(target=_fill_shm, args=(path, nbytes))
    child.start()
    child.join()
    try:
        with open(path, "r+b") as f:
            mm = _mmap.mmap(f.fileno(), nbytes)
        src = torch.frombuffer(mm, dtype=torch.uint8)
        t0 = time.perf_counter()
        fresh = torch.empty(nbytes, dtype=torch.uint8)
        fresh.copy_(src)
        fresh_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fresh.copy_(src)  # now into faulted-in memory (the source's page tables are warm too: a best case)
        warm_s = time.perf_counter() - t0
        del src
        mm.close()
        # What a restarted process's load_into faces: its model's memory is faulted in, but the shared-memory
        # file is mapped afresh (its page tables are built by the copy's faults).
        with open(path, "r+b") as f:
            mm = _mmap.mmap(f.fileno(), nbytes)
        src = torch.frombuffer(mm, dtype=torch.uint8)
        t0 = time.perf_counter()
        fresh.copy_(src)
        mapped_s = time.perf_counter() - t0
        del src, fresh
        mm.close()
    finally:
        os.remove(path)
    return {"bytes": nbytes, "fresh_s": fresh_s, "fresh_GBps": nbytes / fresh_s / 1e9,
            "into_s": warm_s, "into_GBps": nbytes / warm_s / 1e9,
            "into_fresh_map_s": mapped_s, "into_fresh_map_GBps": nbytes / mapped_s / 1e9}
