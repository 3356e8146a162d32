"""Driving the restore section from ``run.py``: the S3 server, the save task, one process per load."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from .labels import own_run_label
from .restore import LOADERS
from .restore_cold import FLAT_TENSORS, ROUNDS, cold_markdown, run_cold


def _s3_server(workdir: Path) -> tuple[Any, dict | None, str | None]:
    """SeaweedFS on loopback, as the tests run it; (None, None, why) when ``weed`` is not installed."""
    try:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.s3server import start_s3_server
    except ImportError as e:
        return None, None, f"tests/s3server.py not importable: {e}"
    try:
        server = start_s3_server(Path(tempfile.mkdtemp(prefix="weed-", dir=workdir)))
    except (RuntimeError, OSError, AssertionError) as e:
        return None, None, f"no S3 server: {e}"
    return server, {"url": server.fresh_url("restore"), "storage_options": dict(server.storage_options)}, None


def run_restore(run: Any, shape: dict, workdir: Path, peer_names: list[str], cold: bool,
                n_flat: int = FLAT_TENSORS, cold_rounds: int = ROUNDS) -> dict[str, Any]:
    root = workdir / "restore"
    shutil.rmtree(root, ignore_errors=True)
    shm_dir = tempfile.mkdtemp(prefix="fastckpt-bench-", dir="/dev/shm")
    server, s3, why = _s3_server(workdir)
    out: dict[str, Any] = {"s3_skipped": why, "loads": []}
    try:
        saved = run("restore: save once per loader", "restore_save",
                    dict(shape=shape, root=str(root), shm_dir=shm_dir, s3=s3, peers=peer_names))
        out["save"] = saved
        if not saved["ok"]:
            return out
        loaders = [name for name in LOADERS if s3 is not None or not name.startswith("fastckpt_s3")]
        loaders += [f"peer_{n}" for n in saved["result"]["peers"]]
        for temp in (("cold", "warm") if cold else ("warm",)):
            for name in loaders:
                if temp == "cold" and (name.startswith("fastckpt_shm") or name.startswith("fastckpt_s3")):
                    continue  # memory and the network have no page cache of ours to drop
                if name.startswith("fastckpt_shm"):  # each load's close() gives the dead process's memory back
                    run("restore: shm snapshot of a crashed process", "restore_shm_save",
                        dict(shape=shape, root=str(root), shm_dir=shm_dir))
                res = run(f"restore: {name} ({temp})", "restore_load",
                          dict(shape=shape, root=str(root), loader=name, cold=temp == "cold", shm_dir=shm_dir, s3=s3))
                out["loads"].append(res)
        if cold:
            out["cold"] = run_cold(run, shape, root, n_flat, cold_rounds)  # its workload case reads the raw ceiling of these files
            out["raw_read"] = out["cold"]["cases"]["workload"]["raw"]
        out["memcpy"] = run("restore: memcpy reference (shm)", "restore_memcpy",
                            dict(nbytes=saved["result"]["state_bytes"], shm_dir=shm_dir))
        if s3 is not None:
            out["s3_whole"] = run("restore: s3fs whole-object GETs", "restore_s3_whole", dict(s3=s3))
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    return out


def _first(row: dict[str, Any]) -> str:
    s = row.get("first_write_s")
    return "n/a" if s is None else f"{s:.3f} s"


def restore_markdown(res: dict[str, Any]) -> list[str]:
    """The report's restore section: one row per loader, cold and warm, with peak RSS and the serving tier."""
    md = ["## Restore (issue 13)", ""] + own_run_label(res.get("meta")) + [
          "Each load in a fresh process; cold = the files' pages dropped first (fsync + POSIX_FADV_DONTNEED), "
          "warm = read once before. Peak RSS = VmHWM above the process's RSS before the call (a template "
          "filled in place is allocated before, as the model is). 'vs torch.load' divides by the same "
          "temperature's torch.load time. 'first write' = writing one byte of every 4 KiB page of the loaded "
          "CPU tensors afterwards (what the first optimizer step pays): a mapped load's deferred copy-on-write "
          "shows there.", ""]
    if not res.get("save", {}).get("ok"):
        return md + [f"n/a: {res.get('save', {}).get('error')}", ""]
    state = res["save"]["result"]["state_bytes"]
    md.append(f"State: {state / 1e9:.2f} GB of tensors. S3: "
              + (res["s3_skipped"] or "SeaweedFS on loopback (fresh bucket prefix)") + ".")
    md.append("")
    rows = [r["result"] for r in res["loads"] if r.get("ok")]
    torch_s = {r["cold"]: r["seconds"] for r in rows if r["loader"] == "torch_load"}
    table = ["| loader | cache | seconds | vs torch.load | GB/s | first write | peak RSS above start | served by | "
             "bit-exact |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = LOADERS.get(r["loader"], (r["loader"].replace("peer_", "peer: "),))[0]
        ref = torch_s.get(r["cold"])
        peak = r.get("peak_rss_above_bytes")
        table.append(f"| {label} | {'cold' if r['cold'] else 'warm'} | {r['seconds']:.3f} | "
                     f"{r['seconds'] / ref:.2f}x | {state / r['seconds'] / 1e9:.2f} | "
                     f"{_first(r)} | {'n/a' if peak is None else f'{peak / 1e9:.2f} GB ({peak / state:.2f}x state)'} | "
                     f"{r.get('tier', '-')} | {r.get('bit_exact', '-')} |" if ref else
                     f"| {label} | {'cold' if r['cold'] else 'warm'} | {r['seconds']:.3f} | n/a | | | | | |")
    md += table + [""]
    for r in res["loads"]:
        if not r.get("ok"):
            md.append(f"- failed: {r.get('error', '')[:300]}")
    raw = res.get("raw_read")
    if raw and raw.get("ok") and "readers" in raw["result"]:
        w = raw["result"]
        ceil = w["readers"][w["best"]]["seconds"]
        cold = {r["loader"]: r["seconds"] for r in rows if r["cold"]}
        at = ", ".join(f"{name} {ceil / cold[key]:.0%}" for key, name in
                       (("torch_load", "torch.load"), ("fastckpt_load", "fastckpt `load()`"),
                        ("fastckpt_load_into", "`load_into()`")) if key in cold)
        each = ", ".join(f"{n} {r['seconds']:.3f} s" for n, r in w["readers"].items())
        md.append(f"- disk ceiling: the shard files' {w['bytes'] / 1e9:.2f} GB read raw by the best of several readers "
                  f"(into faulted-in memory, no checksum; best of {w['reps']} each, cold: {each}): **{w['best']}**, "
                  f"{ceil:.3f} s = {w['bytes'] / ceil / 1e9:.2f} GB/s. Cold loads above reach this fraction of it: "
                  f"{at}. A loader near 100% is bound by the disk; a ratio to torch.load then says how far torch.load "
                  "is from the disk, not how fast a loader can be.")
    mc = res.get("memcpy")
    if mc and mc.get("ok"):
        m = mc["result"]
        shm = {r["loader"]: r for r in rows if r["loader"].startswith("fastckpt_shm")}
        into_map = m.get("into_fresh_map_GBps")
        parts = [f"- shm reference: torch's copy of {m['bytes'] / 1e9:.2f} GB out of a shared-memory file runs at "
                 f"{m['fresh_GBps']:.2f} GB/s into fresh memory, "
                 + (f"{into_map:.2f} GB/s into memory already faulted in from a fresh mapping of the file (what a "
                    "restarted process's `load_into` faces) and " if into_map else "")
                 + f"{m['into_GBps']:.2f} GB/s into memory already faulted in with the file's page tables warm too "
                 "(a best case no restart has)"]
        if "fastckpt_shm" in shm:
            parts.append(f"; the shm-tier `load()` (fresh tensors, every tensor CRC-checked) reaches "
                         f"{state / shm['fastckpt_shm']['seconds'] / 1e9 / m['fresh_GBps']:.0%} of the first")
        if "fastckpt_shm_into" in shm:
            into_gbps = state / shm['fastckpt_shm_into']['seconds'] / 1e9
            parts.append(", `load_into()` (every tensor CRC-checked) "
                         + (f"{into_gbps / into_map:.0%} of the second and " if into_map else "")
                         + f"{into_gbps / m['into_GBps']:.0%} of the best case")
        md.append("".join(parts) + ". The shm tier is read with `pread` of the buffer files (nothing mapped).")
    whole = res.get("s3_whole")
    if whole and whole.get("ok"):
        w = whole["result"]
        fc = [r for r in rows if r["loader"] == "fastckpt_s3"]
        ratio = f"; fastckpt's verified ranged GETs reach {state / fc[0]['seconds'] / 1e9 / w['GBps']:.0%} of it" \
            if fc else ""
        md.append(f"- S3 reference: {w['objects']} shard objects fetched whole by concurrent s3fs GETs "
                  f"(`fs.cat`): {w['bytes'] / 1e9:.2f} GB in {w['seconds']:.2f} s = {w['GBps']:.2f} GB/s{ratio}.")
    if res.get("cold"):
        md += [""] + (cold_markdown(res["cold"]["result"] if "result" in res["cold"] else res["cold"]))
    return md + [""]
