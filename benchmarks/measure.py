"""Measurement primitives and the core measures (issue #2): (a) save() blocking, (b) per-checkpoint
stall, (c) durable-commit bandwidth vs a raw fsync'd write, (d) load time, (e) peak RSS.

Every ``task_*`` function runs inside one (usually fresh) process and returns a JSON-able dict.
"""
from __future__ import annotations

import gc
import mmap
import os
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil
import torch

from . import peers as peers_mod
from . import workload as wl

now = time.perf_counter


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- memory


class RssSampler:
    """Samples this process's RSS (psutil) on a daemon thread; ``peak`` is the max seen."""

    def __init__(self, interval: float = 0.02) -> None:
        self.proc = psutil.Process()
        self.interval = interval
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = self.proc.memory_info().rss
            if rss > self.peak:
                self.peak = rss
            self._stop.wait(self.interval)

    def start(self) -> "RssSampler":
        self._t.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        return self.peak


def rss() -> int:
    return psutil.Process().memory_info().rss


def reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def vm_hwm() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------------------------- files


def raw_fsync_write(path: Path, buf: np.ndarray | memoryview, piece: int = 64 << 20, direct: bool = False) -> float:
    """Sequential os.write of ``buf`` + fsync; returns seconds (the bandwidth yardstick).

    ``direct=True`` opens with O_DIRECT (``buf`` must then be page-aligned): a second, stricter yardstick.
    """
    mv = memoryview(buf).cast("B")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    t0 = now()
    fd = os.open(path, flags, 0o644)
    try:
        while len(mv):
            n = os.write(fd, mv[:piece])
            mv = mv[n:]
        os.fsync(fd)
    finally:
        os.close(fd)
    return now() - t0


def files_under(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    return [p for p in path.rglob("*") if p.is_file()]


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


def drop_cache(path: Path) -> None:
    """Evict the (clean) pages of every file under ``path`` from the page cache."""
    for p in files_under(path):
        drop_file_cache(p)


def drop_file_cache(path: Any) -> None:
    """Evict one file's pages from the page cache (fsync, then POSIX_FADV_DONTNEED): its next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_cache(path: Path, piece: int = 64 << 20) -> None:
    """Read every file under ``path`` once so that it sits in the page cache."""
    buf = bytearray(piece)
    for p in files_under(path):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- stats


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def floor(tensors: list[torch.Tensor], reps: int = 3) -> dict[str, float]:
    """The physical floor on CPU: one memcpy of the state (``copy_`` into preallocated buffers) and one CRC32C
    pass over it, the median of ``reps``."""
    from fastckpt.format.checksum import crc32c

    dst = [torch.empty_like(t) for t in tensors]
    for d, t in zip(dst, tensors):
        d.copy_(t)  # first touch of the destination is not part of a copy into reused buffers
    copies, crcs = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for d in dst:
            crc32c(memoryview(d.reshape(-1).view(torch.uint8).numpy()))
        crcs.append(time.perf_counter() - t0)
    return {"memcpy_s": statistics.median(copies), "crc_s": statistics.median(crcs)}


def stall_estimate(loop_s: float, n_steps: int, base_steps: list[float], n_ckpt: int) -> dict[str, float]:
    """Per-checkpoint stall = (loop time with checkpoints - n x mean baseline step) / #checkpoints.

    Used where the baseline is a separate run (Lightning, Accelerate). ``noise_s`` is one standard error of
    that estimate from the baseline steps' spread (the checkpointed loop is assumed to be as noisy per step as
    the baseline).
    """
    mu = statistics.fmean(base_steps)
    sd = statistics.stdev(base_steps) if len(base_steps) > 1 else 0.0
    var = n_steps * sd**2 + (n_steps**2) * sd**2 / max(len(base_steps), 1)
    return {
        "stall_s": (loop_s - n_steps * mu) / n_ckpt,
        "noise_s": var**0.5 / n_ckpt,
        "base_step_mean_s": mu,
        "base_step_sd_s": sd,
    }


def paired_stall(ckpt_windows: list[float], clean_windows: list[float]) -> dict[str, Any]:
    """Per-checkpoint stall from interleaved windows: clean, ckpt, clean, ..., ckpt, clean.

    Each checkpointed window is compared with the mean of the clean windows on either side of it, so a
    slow drift of the step time within the process (it moves by tens of percent over a minute on a
    shared VM) cancels out instead of landing in the stall. ``stall_s`` is the median of those paired
    differences (one 1-2 s scheduling hiccup in one window does not move it); ``noise_s`` is its standard
    error from the differences' robust spread (1.4826 x MAD, x 1.2533 for a median). ``stall_mean_s`` is
    the plain mean, i.e. "loop time with checkpoints minus without, per checkpoint", for reference.
    """
    if len(clean_windows) != len(ckpt_windows) + 1:
        raise ValueError("need one more clean window than checkpointed windows")
    from fastckpt.timeline import median_and_noise  # the demo (examples/lightning_gpt.py) states the same noise

    diffs = [w - (clean_windows[i] + clean_windows[i + 1]) / 2 for i, w in enumerate(ckpt_windows)]
    m, noise = median_and_noise(diffs)
    return {
        "stall_s": m,
        "noise_s": noise,
        "stall_mean_s": statistics.fmean(diffs),
        "stall_pairs_s": diffs,
    }


# ---------------------------------------------------------------------------------------------- core loop


class Trainer:
    """The plain loop: forward, backward, ``peer.before_optimizer_step()``, ``opt.step()``."""

    def __init__(self, shape: wl.Shape) -> None:
        wl.setup_threads()
        self.model, self.opt = wl.build(shape)
        self.batches = wl.Batches(shape)
        self.pre_step: Callable[[], None] = lambda: None

    def step(self) -> None:
        x, y = self.batches.next()
        loss = wl.loss_fn(self.model, x, y)
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.pre_step()
        self.opt.step()

    def timed_steps(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = now()
            self.step()
            out.append(now() - t0)
        return out

    def state(self, step: int) -> dict:
        return wl.make_state(self.model, self.opt, step)


def zeroed_like(obj: Any) -> Any:
    """Same structure as ``obj`` with every tensor replaced by zeros (a template for in-place loaders)."""
    if isinstance(obj, torch.Tensor):
        return torch.zeros_like(obj)
    if isinstance(obj, dict):
        return type(obj)((k, zeroed_like(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(zeroed_like(v) for v in obj)
    return obj


def first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """None if ``got`` equals ``want`` bit for bit (tensors: dtype, shape, bytes), else where it differs."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: {type(got).__name__} instead of a tensor"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{path}: {got.dtype}{tuple(got.shape)} instead of {want.dtype}{tuple(want.shape)}"
        if not torch.equal(got.detach().cpu().reshape(-1).view(torch.uint8),
                           want.detach().cpu().reshape(-1).view(torch.uint8)):
            return f"{path}: values differ"
        return None
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return f"{path}: {type(got).__name__} instead of a dict"
        if set(got) != set(want):
            return f"{path}: keys {sorted(map(str, set(got) ^ set(want)))[:5]} differ"
        for k in want:
            d = first_difference(want[k], got[k], f"{path}/{k}")
            if d:
                return d
        return None
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"{path}: {type(got).__name__} of another length"
        for i, (w, g) in enumerate(zip(want, got)):
            d = first_difference(w, g, f"{path}/{i}")
            if d:
                return d
        return None
    return None if got == want else f"{path}: {got!r} instead of {want!r}"


def roundtrip(p: peers_mod.Peer, tr: "Trainer", step: int) -> dict[str, Any]:
    """After the timed loop: save the current state once more, wait for it, restore it with the peer's own
    loader (into a zeroed template) and compare bit for bit. No training step in between, so the live state
    is the reference."""
    state = tr.state(step)
    out: dict[str, Any] = {"step": step}
    try:
        t0 = now()
        p.save(state, step)
        p.flush()
        out["save_flush_s"] = now() - t0
        t0 = now()
        loaded = p.load(step, zeroed_like(state))
        out["load_s"] = now() - t0
    except NotImplementedError:
        return {**out, "checked": False}
    except Exception as e:  # noqa: BLE001 - a failed restore is a finding, reported, not a crash
        return {**out, "checked": True, "bit_exact": False, "error": f"{type(e).__name__}: {e}"}
    diff = first_difference(state, loaded)
    del loaded
    gc.collect()
    return {**out, "checked": True, "bit_exact": diff is None, "diff": diff}


def task_calibrate(shape: dict, warmup: int, steps: int) -> dict[str, Any]:
    """The plain loop's step time on this machine, with no checkpointing (run.py sizes K and the window count
    from it). Same allocator setting and thread count as the stall-measuring tasks."""
    wl.tune_malloc()
    tr = Trainer(wl.Shape(**shape))
    tr.timed_steps(warmup)
    ts = tr.timed_steps(steps)
    return {"step_s": statistics.median(ts), "steps_s": ts}


def task_core(peer: str, shape: dict, root: str, warmup: int, every: int, n_ckpt: int,
              base_steps: int, durable_reps: int = 0) -> dict[str, Any]:
    """(a), (b) and peak RSS for one peer, in one process.

    Order: warm-up steps -> ``base_steps`` steps without checkpoints (their peak RSS is the no-checkpoint
    reference) -> warm-up checkpoint (untimed, awaited: plan, allocation, first touch) -> ``warmup`` settle
    steps -> interleaved windows of ``every`` steps: clean, ckpt, clean, ckpt, ..., clean (``n_ckpt``
    checkpointed windows). A checkpointed window is one period of "a checkpoint every K steps" in steady
    state: ``save()`` at its start, K training steps, then the peer's flush (what the next save would wait
    for), all timed. The stall per checkpoint compares it with its two neighbouring clean windows.

    ``durable_reps`` > 0 (the busy-host scenario) then times that many ``save()`` + ``flush()`` pairs back to
    back, after the windows: the time to a durable commit when the caller waits for it.
    """
    root_p = Path(root)
    rmtree(root_p)
    malloc_tuned = wl.tune_malloc()
    tr = Trainer(wl.Shape(**shape))
    p = peers_mod.make(peer, root_p)
    p.attach(tr.model, tr.opt)
    tr.pre_step = p.before_optimizer_step
    tr.timed_steps(warmup)
    state_bytes = wl.tensor_bytes(tr.state(0))
    gc.collect()

    rss_quiet = rss()
    base_sampler = RssSampler().start()
    tr.timed_steps(base_steps)
    base_peak = base_sampler.stop()

    hwm_reset = reset_hwm()
    sampler = RssSampler().start()
    t0 = now()
    p.save(tr.state(0), 0)
    first_block = now() - t0
    tr.step()
    p.flush()
    first_total = now() - t0
    tr.timed_steps(warmup)

    step = 1
    blocks: list[float] = []
    flushes: list[float] = []
    clean: list[list[float]] = []
    ckpt: list[list[float]] = []
    ckpt_windows: list[float] = []
    for w in range(2 * n_ckpt + 1):
        if w % 2 == 0:
            clean.append(tr.timed_steps(every))
            step += every
            continue
        tw = now()
        st = tr.state(step)
        tb = now()
        p.save(st, step)
        blocks.append(now() - tb)
        del st
        ckpt.append(tr.timed_steps(every))
        step += every
        tf = now()
        p.flush()
        flushes.append(now() - tf)
        ckpt_windows.append(now() - tw)
    written = tree_bytes(root_p)  # every checkpoint is complete: each window ends with the peer's flush
    durable: list[float] = []
    for _ in range(durable_reps):
        st = tr.state(step)
        t0 = now()
        p.save(st, step)
        p.flush()
        durable.append(now() - t0)
        del st
        step += 1
    peak = sampler.stop()
    hwm = vm_hwm() if hwm_reset else None
    figures = p.figures()
    restore = roundtrip(p, tr, step)
    p.close()
    rmtree(root_p)
    # issue 27's physical floor on CPU, in this process after the loop: one memcpy of the state into
    # preallocated buffers (and one CRC32C pass), every peer's task alike so the report has several samples
    state_floor = floor(wl.unique_tensors(tr.state(step)))
    clean_windows = [sum(w) for w in clean]
    clean_steps = [s for w in clean for s in w]
    out = {
        "peer": peer,
        "malloc_tuned": malloc_tuned,
        "n_steps": n_ckpt * every,
        "n_ckpt": len(blocks),
        "every": every,
        "state_bytes": state_bytes,
        "bytes_on_disk_per_ckpt": written / (len(blocks) + 1),
        "first_save_block_s": first_block,
        "first_save_total_s": first_total,
        "save_block_s": blocks,
        "save_block_median_s": med(blocks),
        "loop_s": sum(ckpt_windows),
        "ckpt_windows_s": ckpt_windows,
        "clean_windows_s": clean_windows,
        "loop_steps_s": [s for w in ckpt for s in w],
        "flush_s": med(flushes),
        "flushes_s": flushes,
        "base_steps_s": clean_steps,
        "base_step_mean_s": statistics.fmean(clean_steps),
        "base_step_sd_s": statistics.stdev(clean_steps) if len(clean_steps) > 1 else 0.0,
        "rss_quiet": rss_quiet,
        "rss_before_saves": base_peak,
        "peak_rss": peak,
        "peak_rss_hwm": hwm,
        "peer_figures": figures,
        "restore": restore,
        "floor": state_floor,
        "durable_s": durable,
    }
    out.update(paired_stall(ckpt_windows, clean_windows))
    return out


# ---------------------------------------------------------------------------------------------- (c) + (d)


def task_io(shape: dict, root: str, reps: int) -> dict[str, Any]:
    """(c) durable commit vs raw fsync'd write, interleaved; (d) warm load vs torch.load. Cold loads are the restore
    section's (a fresh process each, several rounds): one cold sample here, in a process whose allocator already holds
    the memory of the warm loads, was neither."""
    from fastckpt import CheckpointConfig, Checkpointer

    root_p = Path(root)
    rmtree(root_p)
    root_p.mkdir(parents=True)
    tr = Trainer(wl.Shape(**shape))
    tr.timed_steps(2)
    state = tr.state(2)
    state_bytes = wl.tensor_bytes(state)
    ckpt = Checkpointer(CheckpointConfig(root=os.fspath(root_p / "fastckpt")))
    ckpt.watch(tr.opt)

    # warm-up: arena allocation + plan (reported, not part of the comparison)
    t0 = now()
    h = ckpt.save(state, 0)
    info = h.wait()
    cold_durable = now() - t0
    nbytes = info.nbytes
    buf = np.ones(nbytes, dtype=np.uint8)  # touched: the yardstick writes from resident memory
    dnbytes = -(-nbytes // 4096) * 4096
    dmm = mmap.mmap(-1, dnbytes)  # page-aligned for O_DIRECT
    dbuf = memoryview(dmm)
    np.frombuffer(dmm, dtype=np.uint8)[:] = 1
    direct_s: list[float] = []
    raw_s: list[float] = []
    fc_s: list[float] = []
    fc_block: list[float] = []
    fc_staged: list[float] = []
    prev = info.name
    for r in range(reps):
        order = [("raw", "fc", "direct"), ("fc", "direct", "raw"), ("direct", "raw", "fc")][r % 3]
        for what in order:
            if what == "raw":
                f = root_p / "raw.bin"
                raw_s.append(raw_fsync_write(f, buf))
                f.unlink()
            elif what == "direct":
                f = root_p / "raw_direct.bin"
                try:
                    direct_s.append(raw_fsync_write(f, dbuf, direct=True))
                except OSError as e:  # tmpfs etc.
                    log(f"O_DIRECT yardstick unavailable: {e}")
                f.unlink(missing_ok=True)
            else:
                ckpt.delete(prev).result()
                t0 = now()
                h = ckpt.save(state, r + 1)
                fc_block.append(now() - t0)
                h.wait_staged()
                fc_staged.append(now() - t0)
                info = h.wait()
                fc_s.append(now() - t0)
                prev = info.name
    del buf
    dbuf.release()
    dmm.close()
    ratios = [(nbytes / f) / (nbytes / r) for f, r in zip(fc_s, raw_s)]
    out: dict[str, Any] = {
        "state_bytes": state_bytes,
        "ckpt_bytes": nbytes,
        "cold_durable_s": cold_durable,
        "raw_s": raw_s,
        "fastckpt_durable_s": fc_s,
        "fastckpt_block_s": fc_block,
        "fastckpt_staged_s": fc_staged,
        "raw_MBps": nbytes / 1e6 / med(raw_s),
        "fastckpt_MBps": nbytes / 1e6 / med(fc_s),
        "bw_ratio_pairs": ratios,
        "bw_ratio": med(ratios),
        "raw_direct_s": direct_s,
        "raw_direct_MBps": dnbytes / 1e6 / med(direct_s) if direct_s else None,
        "bw_ratio_vs_direct": med([(dnbytes / f) / (dnbytes / d) for f, d in zip(fc_s, direct_s)]) if direct_s else None,
    }

    # (d) load. torch.save's file, fsync'd so that a later DONTNEED can drop it.
    tpath = root_p / "torch_save.pt"
    t0 = now()
    torch.save(state, tpath)
    out["torch_save_s"] = now() - t0
    fd = os.open(tpath, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    out["torch_save_bytes"] = tpath.stat().st_size
    step_saved = ckpt.latest()
    fc_dir = Path(ckpt.list()[-1].path)
    del state, tr
    gc.collect()

    def load_torch() -> float:
        t0 = now()
        x = torch.load(tpath, map_location="cpu", weights_only=True)
        dt = now() - t0
        del x
        gc.collect()
        return dt

    def load_fc() -> float:
        t0 = now()
        x = ckpt.load(step_saved)
        dt = now() - t0
        del x
        gc.collect()
        return dt

    warm_cache(tpath)
    warm_cache(fc_dir)
    tl, fl = [], []
    for r in range(reps):
        if r % 2 == 0:
            tl.append(load_torch())
            fl.append(load_fc())
        else:
            fl.append(load_fc())
            tl.append(load_torch())
    out.update({"load_warm_torch_s": tl, "load_warm_fastckpt_s": fl,
                "load_warm_ratio": med(fl) / med(tl)})
    ckpt.close()
    rmtree(root_p)
    return out


# ---------------------------------------------------------------------------------------------- (e)


def task_rss(shape: dict, root: str, warmup: int, every: int, n_saves: int, base_steps: int) -> dict[str, Any]:
    """(e) fastckpt's peak RSS over ``n_saves`` saves in the training loop (lazy mode, a save every
    ``every`` steps, nothing awaited in the loop), against the peak RSS of the same loop without
    checkpoints (model, grads, optimizer state, autograd temporaries, runtime) + the state's bytes."""
    from fastckpt import CheckpointConfig, Checkpointer

    root_p = Path(root)
    rmtree(root_p)
    tr = Trainer(wl.Shape(**shape))
    # keep_last=2 bounds the disk footprint of 20 full checkpoints (deletion runs on the committer thread).
    ckpt = Checkpointer(CheckpointConfig.from_dict({"root": os.fspath(root_p), "retention": {"keep_last": 2}}))
    ckpt.watch(tr.opt)
    tr.timed_steps(warmup)
    state_bytes = wl.tensor_bytes(tr.state(0))
    gc.collect()
    rss_quiet = rss()
    base_sampler = RssSampler().start()
    tr.timed_steps(base_steps)
    base_peak = base_sampler.stop()
    hwm_reset = reset_hwm()
    sampler = RssSampler().start()
    blocks = []
    step = 0
    t0 = now()
    for _ in range(n_saves):
        for _ in range(every):
            tr.step()
            step += 1
        st = tr.state(step)
        tb = now()
        ckpt.save(st, step)
        blocks.append(now() - tb)
        del st
    for _ in range(every // 2):
        tr.step()
    loop_s = now() - t0
    tf = now()
    ckpt.wait()
    flush_s = now() - tf
    peak = sampler.stop()
    hwm = vm_hwm() if hwm_reset else None
    counters = ckpt.counters
    persist = [s.persist_s for s in ckpt.stats]
    ckpt.close()
    rmtree(root_p)
    return {
        "n_saves": n_saves,
        "every": every,
        "state_bytes": state_bytes,
        "rss_quiet": rss_quiet,
        "rss_before_saves": base_peak,
        "peak_rss": peak,
        "peak_rss_hwm": hwm,
        "target_bytes": 1.1 * (base_peak + state_bytes),
        "overhead_in_states": (peak - base_peak) / state_bytes,
        "save_block_s": blocks,
        "save_block_median_s": med(blocks),
        "persist_s": persist,
        "loop_s": loop_s,
        "flush_s": flush_s,
        "counters": counters,
    }
