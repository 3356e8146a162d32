"""Is ``copy_file_range`` a win for unchanged ranges of a LOCAL checkpoint file? Measured against what fastckpt does
today: an O_DIRECT write of the staged bytes, then fsync. On a file system with reflinks (XFS with reflink=1,
Btrfs) the copy shares extents; on ext4 it is an in-kernel copy through the page cache, reading the old file.

    python -m benchmarks.dedup_local [DIR] [--mib 256] [--reps 3]
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable


def _fstype(path: Path) -> str:
    """The file system type of the mount that holds ``path``."""
    import psutil

    real = str(path.resolve())
    mounts = [p for p in psutil.disk_partitions(all=True) if real == p.mountpoint or real.startswith(
        p.mountpoint.rstrip("/") + "/")]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype if mounts else "unknown"


def measure(workdir: Path, mib: int = 256, reps: int = 3) -> dict[str, Any]:
    """Median wall and CPU (user + system) seconds of each way to write ``mib`` MiB, fsync included."""
    n = mib << 20
    buf = mmap.mmap(-1, n)
    buf.write(os.urandom(1 << 20) * mib)
    src, dst = workdir / "cfr-src.bin", workdir / "cfr-dst.bin"
    with open(src, "wb") as f:
        f.write(buf)
        f.flush()
        os.fsync(f.fileno())

    def direct() -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
        fd = os.open(dst, flags, 0o644)
        try:
            view, o = memoryview(buf), 0
            while o < n:
                o += os.write(fd, view[o: o + (64 << 20)])
            os.fsync(fd)
        finally:
            os.close(fd)

    def copy(cold: bool) -> Callable[[], None]:
        def run() -> None:
            s = os.open(src, os.O_RDONLY)
            if cold:
                os.posix_fadvise(s, 0, 0, os.POSIX_FADV_DONTNEED)
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                o = 0
                while o < n:
                    o += os.copy_file_range(s, fd, n - o, o, o)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.close(s)
        return run

    ways = {"write": direct, "copy_file_range_cached": copy(False), "copy_file_range_cold": copy(True)}
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in ways}
    try:
        for _ in range(reps):
            for name, fn in ways.items():
                r0, t0 = os.times(), time.perf_counter()
                fn()
                t, r1 = time.perf_counter() - t0, os.times()
                got[name].append((t, (r1.user - r0.user) + (r1.system - r0.system)))
                dst.unlink()
    finally:
        src.unlink(missing_ok=True)
        dst.unlink(missing_ok=True)
    return {"fstype": _fstype(workdir), "mib": mib, "reps": reps, **{
        k: {"wall_s": statistics.median(x[0] for x in v), "cpu_s": statistics.median(x[1] for x in v)}
        for k, v in got.items()}}


def local_markdown(res: dict[str, Any] | None) -> list[str]:
    if not res:
        return []
    w, c, k = res["write"], res["copy_file_range_cached"], res["copy_file_range_cold"]
    return [f"Local files ({res['fstype']}, {res['mib']} MiB, fsync included, median of {res['reps']}): an O_DIRECT "
            f"write of the staged bytes {w['wall_s']:.3f} s ({w['cpu_s']:.3f} s CPU); `copy_file_range` from the "
            f"previous file {c['wall_s']:.3f} s ({c['cpu_s']:.3f} s CPU) with its pages cached, {k['wall_s']:.3f} s "
            f"({k['cpu_s']:.3f} s CPU) cold. "
            + ("Not a win here (no reflinks: the kernel still copies every byte), so local saves keep writing the "
               "staged bytes." if c["wall_s"] >= w["wall_s"] else "A win here."), ""]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dedup_local", description=__doc__.split("\n")[0])
    ap.add_argument("dir", nargs="?", default=str(Path(__file__).resolve().parents[1] / "bench_out"))
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    res = measure(Path(args.dir), args.mib, args.reps)
    print(res)
    print("\n".join(local_markdown(res)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
