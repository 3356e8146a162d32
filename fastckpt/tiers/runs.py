"""The root's record of runs (``.fastckpt-runs.json``): process starts and clean ends, whence the MTBF estimate.

A run that never recorded a clean end (``close()``) died: a failure. Its uptime runs from its start to the last
time it was seen alive (each committed save updates it). The estimate is the posterior mean of an exponential law
under a prior worth one failure at ``prior_mtbf_s``: (prior + total uptime) / (1 + failures), so a fresh root starts
at the prior and converges on what the root lived through. The file is hostile until checked: bounded, validated,
and a damaged one is set aside with a warning (the estimate starts again from the prior), never trusted.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ..config import CadenceOptions
from ..engine.cadence import Cadence, CadenceStats
from ..errors import ConfigError, FastCkptError
from ..storage.protocol import Storage

if TYPE_CHECKING:
    from ..engine.distributed import Coordinator

__all__ = ["RUNS_NAME", "Cadenced", "RootCadence", "RunRecord", "open_cadence"]

log = logging.getLogger("fastckpt")

RUNS_NAME = ".fastckpt-runs.json"  # a leading dot: never a checkpoint name, never collected
_MAX_RUNS = 256  # the newest runs are enough for an estimate, and keep the file small
_MAX_BYTES = 64 * 1024
_MAX_DEPTH = 4  # {"runs": [{...}]} nests three levels


class RunRecord:
    """This process's run in the root's record: ``start()`` once, ``seen()`` after saves, ``end()`` at close."""

    def __init__(self, storage: Storage, clock: Callable[[], float] = time.time) -> None:
        self.storage, self._clock = storage, clock
        self.path = storage.join(storage.url, RUNS_NAME)
        self._runs: list[dict[str, float | None]] = []
        self._mine: dict[str, float | None] | None = None
        self._unwritable = False  # this run's start could not be recorded: its later updates are not tried

    def _read(self) -> list[dict[str, float | None]]:
        try:
            data = _read_bounded(self.storage, self.path, _MAX_BYTES)
            if data is None:
                return []
            if not _shallow(data, _MAX_DEPTH):  # json.loads recurses per level: "[[[[..." would exhaust the stack
                raise ValueError(f"nested deeper than {_MAX_DEPTH} levels")
            doc = json.loads(data)
            runs = doc["runs"] if isinstance(doc, dict) else None
            if not isinstance(runs, list) or not all(_valid(r) for r in runs):
                raise ValueError("not a list of runs {start, seen, end}")
        except (ValueError, KeyError, TypeError, RecursionError, FastCkptError, OSError) as e:
            # FastCkptError: IntegrityError (a FIFO, a device, a link to one) and StorageError (a folder)
            log.warning("fastckpt: ignoring the damaged record of runs %s (%s): the MTBF estimate starts again from "
                        "cadence.prior_mtbf_s; set cadence.mtbf_s to fix it", self.path, e)
            return []
        return runs[-_MAX_RUNS:]

    def _write(self) -> None:
        runs = self._runs[-_MAX_RUNS:]
        self.storage.write_atomic(self.path, json.dumps({"runs": runs}).encode())

    def load(self) -> None:
        """Read the earlier runs without recording this one (a process that does not own the root)."""
        self._runs = self._read()

    def start(self) -> None:
        """Record this process's start (the previous runs read first). A record that cannot be written (a folder
        in its place, a read-only root) is warned about once: this run then goes unrecorded, training goes on."""
        now = self._clock()
        self._runs = self._read()
        self._mine = {"start": now, "seen": now, "end": None}
        self._runs.append(self._mine)
        try:
            self._write()
        except (FastCkptError, OSError) as e:
            self._unwritable = True
            log.warning("fastckpt: could not record this run in %s (%s): it is left out of the record of runs (the "
                        "MTBF estimate goes on from what was read); remove what is in its place to record runs again",
                        self.path, e)

    def seen(self) -> None:
        """This run is alive now (after a save committed): a later failure loses at most what came after. A record
        that cannot be written any more (replaced by a folder, a full disk) is warned about, never raised: the
        integrations call this on the training thread."""
        if self._mine is not None and self._mine["end"] is None and not self._unwritable:
            self._mine["seen"] = self._clock()
            self._try_write("could not update the record of runs %s: %s (the MTBF estimate may count less uptime "
                            "for this run)")

    def end(self) -> None:
        """A clean end: this run did not fail."""
        if self._mine is not None and self._mine["end"] is None:
            self._mine["seen"] = self._mine["end"] = self._clock()
            if not self._unwritable:
                self._try_write("could not record the clean end of this run in %s: %s (the next MTBF estimate "
                                "counts it as a failure)")

    def _try_write(self, warning: str) -> None:
        try:
            self._write()
        except (FastCkptError, OSError) as e:
            log.warning("fastckpt: " + warning, self.path, e)

    def failures(self) -> int:
        """The earlier runs that ended without ``end()``."""
        return sum(1 for r in self._runs if r is not self._mine and r["end"] is None)

    def uptime_s(self) -> float:
        """Seconds the runs of this root were alive, this one up to now."""
        now = self._clock()
        alive = [((now if r is self._mine else r["seen"]) or 0.0, r["start"] or 0.0) for r in self._runs]
        return sum(max(0.0, until - start) for until, start in alive)

    def mtbf_s(self, prior_s: float) -> float:
        """The posterior mean MTBF: (prior + uptime) / (1 + failures)."""
        return (prior_s + self.uptime_s()) / (1 + self.failures())


def _read_bounded(storage: Storage, path: str, limit: int) -> bytes | None:
    """At most ``limit`` bytes of the record (None if there is none), or ``ValueError`` past it. Where the storage
    reads only plain files (``read_plain``: a local root), a FIFO, a device, a folder or a symbolic link is never
    opened for reading: it raises ``ValueError`` naming it, and nothing can block or run for ever."""
    read_plain = getattr(storage, "read_plain", None)
    if read_plain is None:  # a storage without it (a user's): the size first, then a read bounded by it
        if not storage.exists(path):
            return None
        if storage.size(path) > limit:
            raise ValueError(f"larger than {limit} bytes")
        data = storage.read_bytes(path)
    else:
        if not storage.exists(path) and not _is_link(path):
            return None
        data = read_plain(path, 0, limit + 1)
        if data is None:
            raise ValueError("not a regular file (a folder, a FIFO, a device or a symbolic link)")
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


def _is_link(path: str) -> bool:
    try:
        return os.path.islink(path)
    except (OSError, ValueError):  # a URL, a name too long: not a local link
        return False


def _shallow(data: bytes, limit: int) -> bool:
    """Whether the JSON text ``data`` nests arrays and objects at most ``limit`` deep: one pass, no recursion
    (brackets inside strings do not count)."""
    depth, in_string, escaped = 0, False, False
    for byte in data:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # closing quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                return False
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1
    return True


def _valid(run: Any) -> bool:
    if not isinstance(run, dict) or set(run) != {"start", "seen", "end"}:
        return False
    start, seen, end = run["start"], run["seen"], run["end"]
    nums = [v for v in (start, seen, end) if v is not None]
    return (isinstance(start, (int, float)) and isinstance(seen, (int, float))
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) < 1e12 for v in nums)
            and seen >= start)


def open_cadence(options: CadenceOptions, storage: Storage | None, *, agree: Callable[[Any], Any] | None = None,
                 record: bool = True) -> tuple[Cadence, RunRecord | None]:
    """A ``Cadence`` for ``options``; without a configured ``mtbf_s`` its MTBF comes from the root's record of
    runs, where this process's start is recorded (``record``: this process writes it, rank 0 only)."""
    runs = None
    if options.interval == "auto" and options.mtbf_s is None and storage is not None:  # only auto needs the MTBF
        runs = RunRecord(storage)
        if record:
            runs.start()
        else:
            runs.load()
    mtbf = None if runs is None else (lambda: runs.mtbf_s(options.prior_mtbf_s))
    return Cadence(options, mtbf=mtbf, agree=agree), runs



class RootCadence:
    """A ``Checkpointer``'s cadence (``Checkpointer.cadence``): built at the first ``should_save``, fed the stall of
    every finished save, its run recorded in the root (rank 0) when the MTBF is estimated."""

    def __init__(self, options: CadenceOptions, storage: Storage, coord: "Coordinator | None",
                 claim: Callable[[], None], after_saves: Callable[[Callable[[], None]], Any]) -> None:
        self.options, self.storage = options, storage
        self.leader, self.distributed = coord is None or coord.rank == 0, coord is not None
        self._claim, self._after_saves = claim, after_saves
        self.cadence: Cadence | None = None
        self.runs: RunRecord | None = None
        self._costs_seen = 0  # how many of the saver's stats the cadence learnt from
        self.closed = False

    def should_save(self, step: int, stats: Sequence[Any]) -> bool:
        """``Cadence.should_save``, after learning the cost of each save finished since the last call."""
        if self.closed:
            raise FastCkptError("this Checkpointer is closed; create a new one")
        if self.cadence is None:
            o = self.options
            if self.distributed and (o.interval == "auto" or o.every_s is not None):
                # each rank's clock would decide apart, and a save that not every rank joins hangs the others
                raise ConfigError("cadence.interval=auto and cadence.every_s need every rank to agree, which a "
                                  "distributed=True Checkpointer cannot do from a clock: use a fixed cadence.interval, "
                                  "or the Lightning / Accelerate triggers, which agree through the framework")
            if self.leader and o.interval == "auto" and o.mtbf_s is None:
                self._claim()  # the record of runs is a write into the root: take it first
            self.cadence, self.runs = open_cadence(o, self.storage, record=self.leader)
        if len(stats) > self._costs_seen:
            for st in stats[self._costs_seen:]:
                self.cadence.observe_stats(st)
            self._costs_seen = len(stats)
            if self.runs is not None and self.leader:
                done = self._after_saves(self.runs.seen)  # on the committer thread: no write on the training thread
                if done is not None:
                    done.add_done_callback(self._warn_unseen)
        return self.cadence.should_save(step)

    def loaded(self, step: int) -> None:
        """A state of ``step`` was loaded (``Checkpointer.load``/``load_into``): the cadence counts from it."""
        if self.cadence is not None:
            self.cadence.restart(step)
        # else the first should_save starts the clock at its own step

    def _warn_unseen(self, done: Any) -> None:
        err = None if done.cancelled() else done.exception()
        if err is not None:  # the record only informs the MTBF estimate: training goes on
            log.warning("fastckpt: could not update the record of runs %s: %s (the MTBF estimate may count less "
                        "uptime for this run)", self.runs.path if self.runs else RUNS_NAME, err)

    @property
    def stats(self) -> CadenceStats | None:
        """What the cadence chose and why (``CadenceStats``); None before the first ``should_save``."""
        return None if self.cadence is None else self.cadence.stats

    def end(self) -> None:
        """A clean end in the root's record of runs (``Checkpointer.close``): this run did not fail."""
        self.closed = True
        if self.runs is not None and self.leader:
            try:
                self.runs.end()
            except (FastCkptError, OSError) as e:
                log.warning("fastckpt: could not record the clean end of this run in %s: %s (the next MTBF "
                            "estimate counts it as a failure)", self.runs.path, e)


class Cadenced:
    """``Checkpointer.should_save``, kept here with the cadence it asks (the class stays a thin wiring)."""

    cadence: RootCadence

    def should_save(self, step: int) -> bool:
        """Whether to ``save()`` at ``step`` under ``config.cadence`` (N steps, ``every_s`` or Young-Daly ``auto``):
        call it once per step, after the step. See docs/CADENCE.md; ``cadence.stats`` says what it chose and why."""
        return self.cadence.should_save(step, self.stats)  # type: ignore[attr-defined]
