"""Which reading strategy serves a cold local load (``read.strategy``): probed once per device, then remembered.

A cold load is bound by how the device likes to be read, and devices differ: the benchmark VM's virtual disk once
served 8 parallel O_DIRECT requests fastest, and later one buffered stream with the kernel's readahead at least as
fast (issue 27). So with ``read.strategy: auto`` the first cold load on a device times each strategy of
``readers.STRATEGIES`` on ``PROBE_BYTES`` of its own files (a different cold region each, read with the real
reader), and the fastest serves the load and every later one. The
verdict is kept in memory per device (``st_dev``) and on disk, so that a restarted process does not probe again: in
``VERDICT_NAME`` under a ``Checkpointer``'s root, and for a load without a root of its own (the torch zip reader: a
Lightning ``dirpath`` holds nothing but Lightning's files) in the user's cache (``user_root``). Every resume of a
Lightning run is a new process: probing in each cost ~0.08 s of a 1.2 s cold load of 1.48 GB on the benchmark VM.
A load whose files sit mostly in the page cache never probes (the timings would measure memory copies, not the
device) and reads in ``parallel``: memory copies on several threads. A probe reads 2 x 3 x ``PROBE_BYTES`` (the
strategies in turns, twice: a noisy spell hits them alike) and keeps ``DEFAULT`` (``parallel``) unless another
strategy is ``_MARGIN`` faster. ``load()`` and the torch zip reader probe straight into the memory the load fills
(``read_whole``: nothing is read twice; a file the probe touched is verified by one CRC32C pass once complete);
``load_into`` is never probed: its first big cold load is its own trial (``trial_read``, below).

A device keeps one verdict per ``KINDS`` of destination, because the two kinds of load may like different readers:
into fresh memory (``load()``, the torch zip reader: every page is faulted in by the read, which several threads
share) and into memory already faulted in (``load_into``'s model, whose tensors are never page-aligned, so ``direct``
is not among its choices). On the benchmark VM both are best served by ``parallel``: raw readers of the same shards,
cold, each in a fresh process among the loaders' (9 rounds, 2026-11-29), into faulted-in memory 0.40 s median for 8
parallel readers against 0.81 s for one stream (0.63 GB), into fresh memory 1.01 against 1.55 s (1.48 GB).

The verdict only picks among strategies that all read the same verified bytes, so a damaged or planted verdict
file can cost speed, never correctness: it is read bounded, a non-regular file or a symlink is ignored, and a
verdict for another device or an unknown strategy is probed again and replaced.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from typing import Callable, Sequence

from ..errors import ConfigError, IntegrityError
from ..format.checksum import crc32c
from ..storage.local import LocalStorage
from .pagecache import resident_fraction
from .readers import STRATEGIES, Range, read_ranges

__all__ = ["CACHE_ENV", "CHOICES", "DEFAULTS", "KINDS", "PROBE_BYTES", "VERDICT_NAME", "choose", "measure_read",
           "forget", "read_whole", "trial_read", "unread", "user_root", "verdicts"]
log = logging.getLogger("fastckpt")

CHOICES = ("auto",) + STRATEGIES  # what ``read.strategy`` accepts
# The kinds of destination a verdict is for (see above) -> the strategies probed for it
KINDS: dict[str, tuple[str, ...]] = {"fresh": STRATEGIES, "into": ("sequential", "parallel")}
# ``load_into`` is never probed: its first cold load on a device is the trial (``trial_read``). One sequential
# stream needs its readahead to ramp up, which short probe regions do not show: cold reads into a faulted-in scratch
# on the benchmark VM (2026-11-29) of 32 MiB took 36 ms sequential against 31 ms parallel (medians of 4) and 64 MiB
# regions within a load ~50 ms either way (5 probes), while whole 0.63 GB loads took 0.41 against 0.48 s: probes of
# 32 and 64 MiB chose ``parallel`` 11 times out of 11.
SEGMENT_BYTES = 128 << 20  # a trial's segment: one strategy reads it, timed
_FIELD = {"fresh": "strategy", "into": "into"}  # a kind's field in the verdict file ("strategy": the older files')
PROBE_BYTES = 32 << 20  # per strategy: several of each reader's pieces, a few tens of ms on a ~1.5 GB/s disk
_ROUNDS = 2  # each strategy timed this many times, in turns, on regions of its own
# Another strategy replaces DEFAULT only if the probe found it this much faster: ~30 ms probes on a shared VM
# (load average 10 on 2 cores) once chose ``sequential``, which then read 1.8x slower than O_DIRECT.
_MARGIN = 0.10
_PROBE_BELOW = 8  # a load of fewer than this many PROBE_BYTES (cold) is too small to pay for a probe
_WARM = 0.5  # at least this fraction of the files in the page cache: warm, read in parallel, never probed
VERDICT_NAME = ".fastckpt-read.json"  # a leading dot: never a checkpoint name, never collected
_VERDICT_MAX = 4096
# Before a verdict (a small cold load), and the verdict when the probe cannot tell the strategies apart. Buffered
# parallel reads, not O_DIRECT: on the benchmark VM (2026-11-28, cold, fresh process per load, 5 rounds in turns)
# the 32-64 MiB probe regions read as fast either way (27 ms each), but whole loads did not: the 1.48 GB torch file
# by the torch zip reader, median 1.20 s parallel against 1.46 s direct; 0.63 GB of shards by load(), 0.56 s
# against 0.62 s. The kernel's readahead keeps more of the disk's queue busy than 8 requests of 8 MiB.
DEFAULT = "parallel"
# Per kind: into a model's faulted-in memory (``load_into``) too, ``parallel``. One buffered stream reads at two speeds
# on the benchmark VM, from one process to the next: measured each in a fresh process among the loaders' (the
# harness's cold-load rounds, 9, 2026-11-29 15:55), raw readers into faulted-in memory took 0.81 s median for one
# stream against 0.40 s for 8 parallel readers (0.63 GB) and 2.11 against 0.99 s (1.48 GB), though one stream's best
# runs matched parallel's. A verdict of ``sequential`` (a trial in a process where one stream ran fast) then cost
# load_into 2.06-2.49 s in 8 later loads of 1.48 GB out of 9, against ~1.0 s with ``parallel``. (Measured in the
# readers' own process, where one stream always found its fast mode, ``sequential`` had looked the better default.)
DEFAULTS = {"fresh": DEFAULT, "into": DEFAULT}

CACHE_ENV = "FASTCKPT_CACHE_DIR"  # the user cache's folder (default: $XDG_CACHE_HOME/fastckpt or ~/.cache/fastckpt)

_lock = threading.Lock()
_verdicts: dict[tuple[int, str], str] = {}  # (st_dev, kind) -> the strategy probed fastest there, for this process


def measure_read(storage: LocalStorage, path: str, offset: int, length: int, strategy: str, workers: int,
                 out: memoryview) -> float:
    """Seconds to read ``length`` bytes of ``path`` at ``offset`` with ``strategy`` into ``out`` (page-aligned:
    where the load wants these bytes): the probe's one measurement; tests replace it to inject timings."""
    t0 = time.perf_counter()
    read_ranges(storage, [Range(path, offset, out[:length], direct=True)], workers, strategy=strategy)
    return time.perf_counter() - t0


def unread(size: int, probed: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:  # (offset, length) of one file
    """The ``(start, end)`` spans of ``[0, size)`` outside the ``(offset, length)`` regions a probe already read."""
    spans, at = [], 0
    for offset, length in sorted(probed):
        if offset > at:
            spans.append((at, offset))
        at = max(at, offset + length)
    if at < size:
        spans.append((at, size))
    return spans


def read_whole(storage: object, ranges: Sequence[Range], setting: str, workers: int, root: str | None = None) -> str:
    """Read ``ranges`` (each a whole file, offset 0, into page-aligned memory: ``load()``'s shards, a torch file) as
    ``choose`` says; return the strategy. A probe reads its regions straight into the ranges' memory, the rest is
    read after it, and a file the probe touched is verified by one CRC32C pass over it once complete (the pieces
    of the others as they land), with the same ``IntegrityError`` naming the file and ``culprit``."""
    by_path = {r.path: r for r in ranges}
    probed: list[tuple[str, int, int]] = []
    how = choose(storage, [(r.path, len(r.out)) for r in ranges], setting, workers, root,
                 into=lambda path, at, n: by_path[path].out[at:at + n], probed=probed)
    done: dict[str, list[tuple[int, int]]] = {}
    for path, at, n in probed:
        done.setdefault(path, []).append((at, n))
    for r in ranges:
        for at, n in done.get(r.path, ()) if r.on_piece is not None else ():
            r.on_piece(at, n)  # the probe's regions landed in ``r.out`` (within the range: it starts at offset 0)
    rest = [Range(r.path, r.offset + a, r.out[a:b], direct=r.direct, on_piece=_shifted(r.on_piece, a))
            for r in ranges if r.path in done for a, b in unread(len(r.out), done[r.path])]
    read_ranges(storage, [r for r in ranges if r.path not in done] + rest, workers, strategy=how)
    for r in ranges:
        if r.path in done and r.crc is not None and crc32c(r.out) != r.crc:
            what = r.culprit(r.out) if r.culprit is not None else r.what
            raise IntegrityError(f"{r.path}: checksum mismatch{what} (CRC32C {crc32c(r.out):#010x}, expected "
                                 f"{r.crc:#010x}); the file is corrupt. Load an earlier checkpoint (Checkpointer.list()).")
    return how


def trial_read(storage: object, ranges: Sequence[Range], workers: int, on_done: Callable[[Range], None] | None,
               strategies: Sequence[str], default: str = DEFAULT) -> str | None:
    """Read ``ranges`` (a whole cold load) in segments of at most ``SEGMENT_BYTES`` and one file each, in file order,
    timing the ``strategies`` in turns on them: the verdict is ``default`` unless another strategy read every one of
    its segments ``_MARGIN`` faster than ``default``'s fastest (consistently faster, not once); None (all read with
    ``default``) when the load is too short to give each strategy ``_ROUNDS`` timed segments. Nothing is read twice:
    the trial costs the difference between the strategies on the slower's segments, once per device.

    Consistently, because the verdict serves every later load of the device, each in a process of its own, and a
    reader's speed in one process does not carry over: one buffered stream reads at two speeds on the benchmark VM
    from one process to the next (``DEFAULTS``), and a trial judged by each strategy's fastest segment chose it
    after one fast spell, then cost 8 loads out of 9 twice the time (2026-11-29). Judged so, a strategy replaces the
    default where it wins every time (a disk that serves one stream best, say), never on one lucky segment. Not
    timed, read with ``default``: segments under half ``SEGMENT_BYTES`` (a load's last, short file). The timed ones
    take the strategies in the order A B B A A B...: a drift over the load hits each alike."""
    order = sorted(ranges, key=lambda r: (r.path, r.offset))
    segments: list[list[Range]] = []
    size = 0
    for r in order:
        if not segments or size >= SEGMENT_BYTES or segments[-1][-1].path != r.path:
            segments.append([])
            size = 0
        segments[-1].append(r)
        size += len(r.out)
    timed = [k for k in range(len(segments)) if sum(len(r.out) for r in segments[k]) >= SEGMENT_BYTES // 2]
    n = len(strategies)
    if len(timed) < n * _ROUNDS:
        read_ranges(storage, order, workers, on_done, strategy=default)  # type: ignore[arg-type]
        return None
    turn = {k: strategies[j % n if (j // n) % 2 == 0 else n - 1 - j % n] for j, k in enumerate(timed)}
    rates: dict[str, list[float]] = {how: [] for how in strategies}  # bytes per second of each timed segment
    for k, part in enumerate(segments):
        how = turn.get(k, default)
        t0 = time.perf_counter()
        got = read_ranges(storage, part, workers, on_done, strategy=how)  # type: ignore[arg-type]
        if k in turn:
            rates[how].append(got / max(time.perf_counter() - t0, 1e-9))
    bar = max(rates[default]) * (1 + _MARGIN) if default in rates else 0.0
    beat = {how: min(r) for how, r in rates.items() if how != default and min(r) > bar}  # slowest segment wins
    best = max(beat, key=lambda how: beat[how]) if beat else default
    log.info("fastckpt: cold reads into loaded memory on this device: the %r strategy (trial of %d segments: %s)",
             best, len(timed), "; ".join(f"{h} {min(r) / 1e9:.2f}-{max(r) / 1e9:.2f} GB/s" for h, r in rates.items()))
    return best


def _shifted(on_piece: Callable[[int, int], None] | None, by: int) -> Callable[[int, int], None] | None:
    """``on_piece`` of a range, for a part of it that starts ``by`` bytes in."""
    if on_piece is None:
        return None
    return lambda start, n: on_piece(by + start, n)


def verdicts() -> dict[tuple[int, str], str]:
    """This process's verdicts: (device (``st_dev``), kind of ``KINDS``) -> strategy."""
    with _lock:
        return dict(_verdicts)


def forget() -> None:
    """Drop this process's verdicts (the files under the roots stay): the next cold load probes or reads them."""
    with _lock:
        _verdicts.clear()


def choose(storage: object, files: Sequence[tuple[str, int]], setting: str, workers: int,
           root: str | None = None, into: Callable[[str, int, int], memoryview] | None = None,
           probed: list[tuple[str, int, int]] | None = None, kind: str = "fresh",
           trial: Callable[[Sequence[str], str], str | None] | None = None) -> str:
    """The strategy that reads ``files`` (``(path, size)``, the whole load) under ``setting`` (``read.strategy``)
    into destinations of ``kind`` (one of ``KINDS``).

    ``auto``: the device's verdict (this process's, else the one saved under ``root``, or without a root in the
    user's cache, ``user_root``), else a probe when the files are cold and big enough, else the kind's default
    (``DEFAULTS``); ``parallel`` whenever the files are warm. Any storage but a local one: the default (it ignores
    the strategy). With ``into(path, offset, length)`` (page-aligned memory where the load wants those bytes) the
    probe reads into it and appends each region it read to ``probed``
    (``(path, offset, length)``): the load then reads only the rest (``read_whole``), so the probe costs nothing.
    With ``trial(strategies, default)`` the load itself stands in for the probe: it reads everything, timing
    ``strategies`` on its parts, and returns the verdict (``trial_read``), or None to keep the default unsaved.
    With neither, there is nothing to probe into: a cold load without a verdict reads with the default."""
    if setting not in CHOICES:
        raise ConfigError(f"read.strategy must be one of {', '.join(CHOICES)}; got {setting!r}")
    if setting != "auto":
        return setting
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
    default = DEFAULTS[kind]
    files = [(p, n) for p, n in files if n > 0]
    if not isinstance(storage, LocalStorage) or not files:
        return default
    total = sum(n for _, n in files)
    cached = sum(n * resident_fraction(p, n) for p, n in files)
    if cached >= _WARM * total:
        return "parallel"  # page-cache copies: several threads, no probe (its timings would not be the disk's)
    try:
        device = os.stat(files[0][0]).st_dev
    except OSError:
        return default  # the read itself reports the missing file, naming it
    with _lock:
        known = _verdicts.get((device, kind))
    keep = root if root is not None else user_root(device)
    if known is None and keep is not None:
        known = _load_verdict(keep, device, kind)
    if known is None:
        if total - cached < _PROBE_BELOW * PROBE_BYTES:
            return default
        if trial is not None:
            known = trial(KINDS[kind], default)
        elif into is not None:
            known = _probe(storage, files, workers, into, probed, KINDS[kind])
        if known is None:
            return default
        if keep is not None:
            if root is None:
                _make_private_dir(keep)
            _save_verdict(keep, device, kind, known)
    with _lock:
        _verdicts[(device, kind)] = known
    return known


def _probe(storage: LocalStorage, files: Sequence[tuple[str, int]], workers: int,
           into: Callable[[str, int, int], memoryview], probed: list[tuple[str, int, int]] | None,
           strategies: Sequence[str] = STRATEGIES) -> str | None:
    """Time every one of ``strategies`` ``_ROUNDS`` times, each on a cold region of its own (the last ones of the
    load), read ``into`` the load's memory; the fastest, or None if no region is cold or a read fails (the load
    reports it)."""
    regions = _regions(files, len(strategies) * _ROUNDS)
    if regions is None:
        return None
    timings: dict[str, float] = {}
    try:  # in turns (a noisy spell hits every strategy alike), each strategy's best
        for k, (path, offset) in enumerate(regions):
            strategy = strategies[k % len(strategies)]
            out = into(path, offset, PROBE_BYTES)
            seconds = measure_read(storage, path, offset, PROBE_BYTES, strategy, workers, out)
            timings[strategy] = min(seconds, timings.get(strategy, seconds))
            if probed is not None:
                probed.append((path, offset, PROBE_BYTES))
    except Exception as e:  # noqa: BLE001 - the load itself reads these files and raises what is wrong, named
        log.debug("read strategy probe failed: %s", e)
        return None
    best = min(timings, key=lambda s: timings[s])
    if timings[DEFAULT] <= timings[best] * (1 + _MARGIN):
        best = DEFAULT  # within the probe's noise of the fastest: what whole loads measured fastest (above)
    log.info("fastckpt: cold reads on this device are fastest with the %r strategy (probe of %d MiB each: %s)",
             best, PROBE_BYTES >> 20, ", ".join(f"{s} {t * 1e3:.0f} ms" for s, t in timings.items()))
    return best


def _regions(files: Sequence[tuple[str, int]], count: int) -> list[tuple[str, int]] | None:
    """``count`` disjoint page-aligned ``PROBE_BYTES`` regions, from the end of the load backwards, none cached."""
    out: list[tuple[str, int]] = []
    for path, size in reversed(files):
        at = (size - PROBE_BYTES) // 4096 * 4096
        while at >= 0 and len(out) < count:
            out.append((path, at))
            at -= PROBE_BYTES
    if len(out) < count or any(_cached(p, at) for p, at in out):
        return None
    return out


def _cached(path: str, offset: int) -> bool:
    # resident_fraction looks at a file's first bytes: a region counts as cached when its file is mostly
    return resident_fraction(path, offset + PROBE_BYTES) > _WARM


def user_root(device: int) -> str | None:
    """The folder of ``device``'s verdict for loads without a root: ``$FASTCKPT_CACHE_DIR`` (empty: none, memory
    only), else ``$XDG_CACHE_HOME/fastckpt``, else ``~/.cache/fastckpt``; then ``read-strategy/<device>``."""
    base = os.environ.get(CACHE_ENV)
    if base is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "fastckpt") if os.path.isabs(xdg) else ""
    return os.path.join(base, "read-strategy", str(device)) if base else None


def _make_private_dir(path: str) -> None:
    """Create ``path`` (the user cache's folder of a verdict), readable by its owner only; a failure leaves the
    verdict in memory (``_save_verdict`` logs it)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        log.debug("could not create the read strategy cache %s: %s", path, e)


def _load_verdict(root: str, device: int, kind: str) -> str | None:
    """The verdict saved under ``root`` for ``device`` and ``kind``; None if absent, unreadable, foreign or
    malformed."""
    rec = _load_record(root, device)
    got = rec.get(_FIELD[kind]) if rec is not None else None
    return got if got in KINDS[kind] else None


def _load_record(root: str, device: int) -> dict | None:
    """The verdict file under ``root`` if it is ``device``'s: a regular file, small, a JSON object; else None."""
    path = os.path.join(root, VERDICT_NAME)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None  # a FIFO or a device planted there: never read
        raw = os.read(fd, _VERDICT_MAX + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        rec = json.loads(raw) if len(raw) <= _VERDICT_MAX else None
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict) or rec.get("device") != device:
        return None
    return rec


def _save_verdict(root: str, device: int, kind: str, strategy: str) -> None:
    """Write the verdict under ``root`` by rename (readers see the old one or the new one), keeping the verdicts of
    the other kinds that are valid; a read-only root keeps it in memory only. Two processes probing two kinds at
    once may lose one of the two: that kind is probed again by a later load, nothing worse."""
    old = _load_record(root, device) or {}
    rec = {"device": device, **{f: old[f] for k, f in _FIELD.items() if old.get(f) in KINDS[k]}}
    rec.update({_FIELD[kind]: strategy, "probed_at": time.time()})
    path = os.path.join(root, VERDICT_NAME)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, json.dumps(rec).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        log.debug("could not save the read strategy verdict under %s: %s", root, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass

