"""Validated configuration. One YAML schema serves the core and both integrations.

Every field is validated in ``__post_init__`` and errors name the field and the
allowed values, so a typo in ``fastckpt.yaml`` fails at start-up instead of
silently falling back to a default.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from .configbase import Freezable as _Freezable
from .configbase import check_choice as _check_choice
from .configbase import check_int as _check_int
from .configbase import check_seconds as _check_seconds
from .configtime import CadenceOptions, PreemptionOptions
from .errors import ConfigError
from .yamlfile import load_yaml, read_yaml

__all__ = [
    "CheckpointConfig",
    "config_mapping",
    "load_yaml",
    "StagingOptions",
    "PersistOptions",
    "RetentionOptions",
    "RemoteOptions",
    "NetworkOptions",
    "PreemptionOptions",
    "CadenceOptions",
    "HealthOptions",
    "ReadOptions",
    "SECTIONS",
]

_MODES = ("lazy", "eager")
_ON_MUTATION = ("raise", "retake")
_WHEN_BUSY = ("wait", "skip")
_COMPILED_PASS = ("auto", "on", "off")  # staging.compiled_pass (fastckpt/format/fused.py)
_DEVICE_SNAPSHOT = ("auto", "on", "off")  # staging.device_snapshot (fastckpt/engine/devicesnap.py)
_DIRECT_IO = ("auto", "on", "off")
_REFLINK = ("auto", "off")  # persist.reflink: clone unchanged shards on a local root (fastckpt/storage/reflink.py)
_BACKGROUND_CPUS = ("auto", "all")  # or a list of CPU ids: persist.background_cpus (fastckpt/engine/affinity.py)
_PROCESS = ("off", "on", "auto")  # persist.process: who writes staged snapshots (fastckpt/tiers/persister.py)
_UNHEALTHY = ("count", "delete", "keep")
_READ_STRATEGIES = ("auto", "sequential", "parallel", "direct")  # fastckpt/read/strategy.py's CHOICES

# The CPU priorities ``persist.priority`` accepts (engine/priority.py applies them).
PRIORITIES = ("idle", "low", "normal")


@dataclass(kw_only=True, slots=True)
class StagingOptions(_Freezable):
    """How state is copied to host memory."""

    _prefix = "staging."
    mode: str = "lazy"
    """``lazy``: optimizer-managed tensors are copied in the background until the next
    ``optimizer.step()``; ``eager``: everything is copied inside ``save()``."""
    slots: int = 2
    """Snapshots in flight at once; each slot owns a reusable host buffer set."""
    when_busy: str = "wait"
    """``wait`` blocks ``save()`` until a slot frees; ``skip`` drops the save and reports it."""
    max_host_bytes: int | None = None
    """Upper bound on staging memory. Past it, one slot streams through a ring of chunk buffers."""
    shm: bool = False
    """Stage in shared memory: a snapshot staged before a crash is persisted by the next process."""
    shm_dir: str = "/dev/shm"
    """Where shared-memory staging files live (a tmpfs)."""
    on_mutation: str = "raise"
    """What happens to a lazy snapshot whose sources changed between ``save()`` and its seal (the next
    ``optimizer.step()``, ``wait()``, ``close()`` or ``save()``): ``raise`` discards it and raises
    ``SnapshotMutatedError`` once (at that ``save()``, else the next ``save``/``wait``/``close``); ``retake``
    takes it again eagerly at the seal, same name and metadata, holding the values at the seal, copies the keys
    that moved eagerly in every later save, and warns once (``RetakenSnapshotWarning``). With
    ``distributed=True``, ``retake`` acts as ``raise``."""
    crc_in_copy: bool = True
    """Take each tensor's CRC32C and health statistics in the copy thread, block by block, while the block it just
    staged is in cache, instead of in the I/O workers reading the staged bytes again (plain CPU tensors, the open
    layout; lazy copies only). Once the training thread waits for staging, the rest is staged plainly and the I/O
    workers measure it. On the 2-core benchmark VM at 0.36 s steps it cut the background threads' CPU per
    checkpoint by about 30% (BENCHMARKS.md, "Where the stall goes"); ``false``: two passes, as before."""
    compiled_pass: str = "auto"
    """Take that one pass (and the I/O workers' CRC32C and statistics of staged CUDA shards) in one compiled call a
    shard that holds no GIL (numba, format/fused.py), instead of a handful of torch calls per 8 MiB: a launch-bound
    training thread waits each time a background thread takes the GIL back. The kernel is compiled once per machine
    in a low-priority child process and loaded from numba's cache once per process (about 0.3 s of one GIL hold, in
    the background); shards take the batched torch pass until it is ready. ``auto``: the warm-up starts at the first
    save of 64 MiB or more, or at ``prewarm()``; ``on``: warmed when the ``Checkpointer`` is made, a failed warm-up
    warns; ``off``: never (the batched torch pass everywhere). Without numba installed ``auto`` quietly keeps the
    torch pass."""

    device_snapshot: str = "off"
    """CUDA states: ``save()`` copies the state's CUDA tensors into a buffer on their own device (one fused
    device-to-device copy per device and dtype on the current stream, about 1 ms for 2 GB on an H100), and the
    copies to the host read that buffer over the next steps, so ``optimizer.step()`` never waits for them (no
    mutation check either: the snapshot holds the values at ``save()``). The buffer (the state's size, per device) is
    kept and reused. ``auto``: only while the device's free memory (``torch.cuda.mem_get_info``) exceeds what the
    buffer still needs by the larger of 1 GiB and a tenth of the device, else the buffer is given back and the save
    copies from the live tensors; ``on``: whenever the buffer can be allocated; ``off``: never. A refused allocation
    is caught and said once: the save goes on without a snapshot. ``SaveStats.device_snapshot`` says which way each
    save went (fastckpt/engine/devicesnap.py)."""

    def validate(self) -> None:
        _check_choice("staging.", "mode", self.mode, _MODES)
        _check_choice("staging.", "device_snapshot", self.device_snapshot, _DEVICE_SNAPSHOT)
        if isinstance(self.compiled_pass, bool):  # YAML 1.1 reads a bare on/off as true/false
            self.compiled_pass = "on" if self.compiled_pass else "off"
        _check_choice("staging.", "compiled_pass", self.compiled_pass, _COMPILED_PASS)
        if not isinstance(self.crc_in_copy, bool):
            raise ConfigError(f"staging.crc_in_copy must be true or false, got {self.crc_in_copy!r}")
        _check_int("staging.", "slots", self.slots, 1)
        _check_choice("staging.", "when_busy", self.when_busy, _WHEN_BUSY)
        _check_choice("staging.", "on_mutation", self.on_mutation, _ON_MUTATION)
        _check_int("staging.", "max_host_bytes", self.max_host_bytes, 1, allow_none=True)
        if not isinstance(self.shm, bool):
            raise ConfigError(f"staging.shm must be true or false, got {self.shm!r}")
        if not isinstance(self.shm_dir, str) or not self.shm_dir:
            raise ConfigError(f"staging.shm_dir must be a directory path, got {self.shm_dir!r}")


@dataclass(kw_only=True, slots=True)
class PersistOptions(_Freezable):
    """How staged bytes reach storage."""

    _prefix = "persist."
    workers: int = 2
    """I/O worker threads (writes, uploads, reads on load)."""
    cpu_threads: int | str = "auto"
    """How many background threads may do CPU-bound work at once (the lazy copy, checksums and health statistics,
    content hashes, buffered writes); the I/O waits themselves are not counted. ``auto``: the CPUs this process may
    use minus those training uses (``torch.get_num_threads()`` for a CPU state, one thread for a GPU state), at
    least one; the copy thread goes first (fastckpt/engine/cpugate.py). An integer >= 1 sets it."""
    background_cpus: str | list[int] = "auto"
    """Where the background threads (the copy, I/O and commit threads, and a persister process's) run: ``auto``
    on the last ``cpu_threads`` CPUs this process may use (at most all but one; none where it may use one, or where
    torchrun started several ranks on the node), and at each ``save()`` never on the CPU the training thread runs on
    then, so that they do not take turns with training on its core; ``all``
    wherever the scheduler puts them; or a list of CPU ids (fastckpt/engine/affinity.py). Training's own threads are
    never moved."""
    chunk_bytes: int = 128 * 1024 * 1024
    """Target size of one tensor file; the unit of the copy -> write pipeline."""
    verify_on_load: bool = True
    """Check every file's size and checksum before using it."""
    direct_io: str = "auto"
    """O_DIRECT for local writes: ``auto`` tries it and falls back, ``on`` requires it, ``off``."""
    fsync: bool = True
    """fsync data files and the directory before the manifest commits."""
    priority: str = "normal"
    """CPU priority of the I/O, commit and upload threads: ``normal`` (the training thread's), ``low``
    (nice 19) or ``idle`` (SCHED_IDLE: only CPU time nothing else wants). The copy thread always runs at normal
    priority. Lowered threads still take the GIL between their native calls: on a host whose cores other
    processes keep busy, one preempted while holding it stalls the training thread for seconds, so lower them
    only where nothing but training runs (fastckpt/engine/priority.py)."""
    max_lag_s: float = 60.0
    """How long a checkpoint may stay not durable before a later ``save()`` warns that persistence is falling
    behind (once per process, on rank 0, naming the measured lag). A save that must wait for a staging slot
    always warns."""
    process: str = "off"
    """Who writes staged snapshots (needs ``staging.shm``): ``off`` this process's threads; ``on`` a long-lived
    persister process (one per ``Checkpointer``) that writes, fsyncs and commits them, and commits a staged snapshot
    even if training is killed; ``auto`` the process for states of at least 256 MiB on the CPU, the threads for
    smaller ones and for CUDA states (measured: docs/DESIGN.md, "The persister process")."""
    reflink: str = "auto"
    """Local roots: ``auto`` makes a shard laid out as a shard of the newest committed checkpoint of the root, at
    least half its bytes unchanged, as a reflink clone of that file with only its header and changed tensors written
    (where the file system has reflinks, such as btrfs or XFS, probed once; the clone stays valid when the older
    checkpoint is deleted); ``off`` always writes."""
    pace_writes: bool = False
    """Pace the I/O workers' shard writes to the write bandwidth measured on earlier writes (a token bucket), so
    a checkpoint's writes are spread instead of bursting. Off by default: no measured gain with O_DIRECT writes,
    which leave no page-cache burst to smooth (BENCHMARKS.md, "Where the stall goes")."""

    def validate(self) -> None:
        if isinstance(self.process, bool):  # YAML 1.1 reads a bare on/off as true/false
            self.process = "on" if self.process else "off"
        if isinstance(self.direct_io, bool):  # YAML 1.1 reads a bare on/off as true/false
            self.direct_io = "on" if self.direct_io else "off"
        _check_int("persist.", "workers", self.workers, 1)
        if self.cpu_threads != "auto" and (isinstance(self.cpu_threads, bool) or not isinstance(self.cpu_threads, int)
                                           or self.cpu_threads < 1):
            raise ConfigError(f"persist.cpu_threads must be auto or an integer >= 1, got {self.cpu_threads!r}")
        cpus = self.background_cpus
        if isinstance(cpus, (list, tuple)) and cpus and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0
                                                            for c in cpus):
            self.background_cpus = sorted(set(cpus))
        elif not isinstance(cpus, str) or cpus not in _BACKGROUND_CPUS:
            raise ConfigError("persist.background_cpus must be auto, all or a non-empty list of CPU ids (integers "
                              f">= 0), got {cpus!r}")
        _check_int("persist.", "chunk_bytes", self.chunk_bytes, 4096)
        if not isinstance(self.verify_on_load, bool):
            raise ConfigError(f"persist.verify_on_load must be true or false, got {self.verify_on_load!r}")
        _check_choice("persist.", "direct_io", self.direct_io, _DIRECT_IO)
        if not isinstance(self.fsync, bool):
            raise ConfigError(f"persist.fsync must be true or false, got {self.fsync!r}")
        _check_choice("persist.", "priority", self.priority, PRIORITIES)
        _check_seconds("persist.", "max_lag_s", self.max_lag_s, 0.0)
        _check_choice("persist.", "process", self.process, _PROCESS)
        if isinstance(self.reflink, bool):  # YAML 1.1 reads a bare off as false
            self.reflink = "auto" if self.reflink else "off"
        _check_choice("persist.", "reflink", self.reflink, _REFLINK)
        if not isinstance(self.pace_writes, bool):
            raise ConfigError(f"persist.pace_writes must be true or false, got {self.pace_writes!r}")


@dataclass(kw_only=True, slots=True)
class RetentionOptions(_Freezable):
    """Which committed checkpoints to keep."""

    _prefix = "retention."
    keep_last: int | None = None
    """Keep the newest N committed checkpoints (null keeps all)."""
    keep_every_n_steps: int | None = None
    """Also keep every checkpoint whose step is a multiple of N."""
    unhealthy: str = "count"
    """What a checkpoint holding NaN or Inf values does to retention: ``count`` (kept and counted in
    ``keep_last`` like any other), ``delete`` (not counted, and removed unless it is the newest) or ``keep``
    (not counted, never removed). Whatever the choice, the newest healthy checkpoint is never removed."""

    def validate(self) -> None:
        _check_int("retention.", "keep_last", self.keep_last, 1, allow_none=True)
        _check_int("retention.", "keep_every_n_steps", self.keep_every_n_steps, 1, allow_none=True)
        _check_choice("retention.", "unhealthy", self.unhealthy, _UNHEALTHY)


_LOCAL_SCHEMES = ("file", "local")


@dataclass(kw_only=True, slots=True)
class RemoteOptions(_Freezable):
    """The remote tier: every checkpoint committed under ``root`` is then uploaded here in the background."""

    _prefix = "remote."
    url: str | None = None
    """fsspec URL of the remote copy (``s3://bucket/run1``, ``memory://x``); null disables the tier."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to the remote fsspec filesystem (credentials, ``client_kwargs.endpoint_url``...)."""
    workers: int = 4
    """Files uploaded at once."""
    keep_last: int | None = None
    """Keep the newest N checkpoints on the remote (null keeps all); ``retention`` governs ``root``."""
    dedup: bool = True
    """On S3, copy the byte ranges whose content hash the newest uploaded checkpoint already holds server-side
    (``UploadPartCopy``) instead of sending them again; each object stays complete and self-contained. Also
    governs a ``root`` on S3 itself: its shards against the root's newest checkpoint, and ``save_file``'s torch
    files (Lightning's ``.ckpt``) against the folder's newest one."""

    def validate(self) -> None:
        if not isinstance(self.dedup, bool):
            raise ConfigError(f"remote.dedup must be true or false, got {self.dedup!r}")
        if self.url is not None:
            if not isinstance(self.url, str) or not self.url.strip():
                raise ConfigError(f"remote.url must be an fsspec URL such as s3://bucket/run or null, got {self.url!r}")
            scheme = self.url.split("://", 1)[0].lower() if "://" in self.url else ""
            if not scheme or scheme in _LOCAL_SCHEMES:
                raise ConfigError(
                    f"remote.url must be an fsspec URL with a remote scheme (s3://bucket/run, gs://..., memory://...), "
                    f"not a local path; got {self.url!r}. Local checkpoints go to root")
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"remote.storage_options must be a mapping, got {type(self.storage_options).__name__}")
        self.storage_options = dict(self.storage_options)
        _check_int("remote.", "workers", self.workers, 1)
        _check_int("remote.", "keep_last", self.keep_last, 1, allow_none=True)


@dataclass(kw_only=True, slots=True)
class NetworkOptions(_Freezable):
    """Deadlines and retries of every request to an fsspec storage (an ``s3://`` root and ``remote.url``).

    A silent network partition must fail a save, never hang training: each request (one PUT, one
    multipart part, one ranged GET, one listing: at most 32 MiB) gets ``timeout_s``, enforced by
    fastckpt itself even where botocore or aiohttp would wait forever; a transient failure (timeout,
    reset, refused) is retried ``retries`` times, waiting ``backoff_s``, then twice that, and so on;
    then the operation raises a ``StorageError``.
    """

    _prefix = "network."

    timeout_s: float = 60.0
    """Deadline of one request, in seconds (also botocore's connect/read timeouts unless
    ``config_kwargs`` sets them)."""
    retries: int = 2
    """Extra attempts after a transient failure; 0 fails at the first one."""
    backoff_s: float = 1.0
    """Wait before the first retry; doubled before each next one."""

    def validate(self) -> None:
        _check_seconds("network.", "timeout_s", self.timeout_s, 0.001)
        _check_int("network.", "retries", self.retries, 0)
        _check_seconds("network.", "backoff_s", self.backoff_s, 0.0)


@dataclass(kw_only=True, slots=True)
class HealthOptions(_Freezable):
    """Health of every checkpoint, measured by the background workers on the staged copy (format/health.py)."""

    _prefix = "health."
    enabled: bool = True
    """Measure each tensor while persisting: NaN/Inf counts, absolute max, L2 norm (float64) and a sampled
    content fingerprint, recorded in the manifest (a torch file: its extended attribute). Never on the training
    thread."""
    stale_warning: bool = True
    """Warn (``StaleCheckpointWarning``, once per ``Checkpointer``) when a checkpoint's parameters are
    bit-identical to the previous checkpoint's although a watched optimizer stepped in between."""

    def validate(self) -> None:
        for name in ("enabled", "stale_warning"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"health.{name} must be true or false, got {getattr(self, name)!r}")


@dataclass(kw_only=True, slots=True)
class ReadOptions(_Freezable):
    """How a load reads local files (fastckpt/read/strategy.py)."""

    _prefix = "read."
    strategy: str = "auto"
    """How cold local files are read: ``sequential`` (buffered, in file order, one reading thread with the kernel's
    readahead ahead of it, the checksums on a second), ``parallel`` (8 threads of buffered 8 MiB reads), ``direct``
    (the same with O_DIRECT where the bytes land in a fresh buffer), or ``auto``: on the first cold load of a device
    big enough to tell (at least 256 MiB), each strategy timed twice, in turns, on 32 MiB regions of its own files
    (``load()``, the torch zip reader), or, for ``load_into``, sequential and parallel in turns on its own 128 MiB
    segments; the fastest kept per device and kind of load (the default, ``parallel``, unless another is 10% faster:
    for ``load_into``, in every one of its segments), in memory and in ``ROOT/.fastckpt-read.json``. Every strategy
    verifies the same checksums; warm files are always copied on several threads."""

    def validate(self) -> None:
        _check_choice("read.", "strategy", self.strategy, _READ_STRATEGIES)


# The nested sections of ``CheckpointConfig``: field name -> its dataclass (built from a mapping by name;
# ``tools/configref`` documents each).
SECTIONS: dict[str, type] = {
    "staging": StagingOptions,
    "persist": PersistOptions,
    "retention": RetentionOptions,
    "remote": RemoteOptions,
    "network": NetworkOptions,
    "preemption": PreemptionOptions,
    "cadence": CadenceOptions,
    "health": HealthOptions,
    "read": ReadOptions,
}


@dataclass(kw_only=True, slots=True)
class CheckpointConfig(_Freezable):
    """Everything a ``Checkpointer`` needs. Build it in code, ``from_dict`` or ``from_yaml``."""

    root: str
    """Where checkpoints live: a local path or any fsspec URL (``s3://``, ``memory://``)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to the fsspec filesystem (credentials, ``client_kwargs.endpoint_url``...)."""
    staging: StagingOptions = field(default_factory=StagingOptions)
    persist: PersistOptions = field(default_factory=PersistOptions)
    retention: RetentionOptions = field(default_factory=RetentionOptions)
    remote: RemoteOptions = field(default_factory=RemoteOptions)
    network: NetworkOptions = field(default_factory=NetworkOptions)
    preemption: PreemptionOptions = field(default_factory=PreemptionOptions)
    cadence: CadenceOptions = field(default_factory=CadenceOptions)
    health: HealthOptions = field(default_factory=HealthOptions)
    read: ReadOptions = field(default_factory=ReadOptions)
    allowed_classes: list[str] = field(default_factory=list)
    """Extra ``module.QualName`` classes the safe loader may rebuild (non-plain leaves)."""
    orphan_grace_s: float | None = 3600.0
    """A folder left under ``root`` by a save that died before its commit is removed by the next Checkpointer
    (and ``fastckpt gc``) once nothing in it changed for this long and, on a local root, no live writer holds
    the root; null never removes them (see fastckpt/tiers/gc.py)."""

    def validate(self) -> None:
        if isinstance(self.root, os.PathLike):
            self.root = os.fspath(self.root)
        if not isinstance(self.root, str) or not self.root.strip():
            raise ConfigError(f"root must be a non-empty path or URL, got {self.root!r}")
        self.root = _expand_user(self.root)
        if not isinstance(self.storage_options, Mapping):
            raise ConfigError(f"storage_options must be a mapping, got {type(self.storage_options).__name__}")
        self.storage_options = dict(self.storage_options)
        if not isinstance(self.allowed_classes, (list, tuple)) or not all(
                isinstance(c, str) and "." in c for c in self.allowed_classes):
            raise ConfigError(f"allowed_classes must be a list of 'module.QualName' strings, got {self.allowed_classes!r}")
        self.allowed_classes = list(self.allowed_classes)
        g = self.orphan_grace_s
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 <= g < float("inf")):
            raise ConfigError(f"orphan_grace_s must be a number of seconds >= 0 or null, got {g!r}")
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            if isinstance(value, Mapping):
                setattr(self, name, _build_section(name, cls, value))
            elif isinstance(value, cls) and value.frozen:  # dataclasses.replace of a config in use: a new config
                setattr(self, name, copy.copy(value))
            elif not isinstance(value, cls):
                raise ConfigError(f"{name} must be a mapping or {cls.__name__}, got {type(value).__name__}")
        if self.remote.url is not None and _same_place(self.remote.url, self.root):
            raise ConfigError(f"remote.url must differ from root (both are {self.root!r}): the remote tier is a "
                              "second copy; set remote.url to another location or null")
        if self.persist.process == "on" and not self.staging.shm:
            raise ConfigError("persist.process: on needs staging.shm: true (the persister process reads the staged "
                              "snapshots from shared memory); set staging.shm: true, or persist.process: off or auto")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CheckpointConfig":
        """Build from a plain mapping (the YAML schema); unknown keys are errors."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"a fastckpt config must be a mapping, got {type(data).__name__}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted((k for k in data if k not in allowed), key=repr)  # keys of any type (YAML: 1, null)
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}{_did_you_mean(unknown, allowed)}; allowed "
                              f"top-level fields: {sorted(allowed)}")
        if "root" not in data:
            raise ConfigError("config field 'root' is required (a local path or an fsspec URL such as s3://bucket/run)")
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: str | Path) -> "CheckpointConfig":
        """Read a YAML file holding the schema documented in docs/API.md (bounded: see fastckpt/yamlfile.py)."""
        data = read_yaml(path)
        try:
            return cls.from_dict({} if data is None else data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """The YAML schema as plain data (round-trips through ``from_dict``)."""
        return dataclasses.asdict(self)


def config_mapping(source: "CheckpointConfig | Mapping[str, Any] | str | Path | None") -> dict[str, Any]:
    """The raw schema mapping behind any config source the integrations accept.

    ``root`` may be missing here (an integration can derive it, e.g. from Accelerate's
    ``project_dir``); ``CheckpointConfig.from_dict`` validates the finished mapping.
    """
    if source is None:
        return {}
    if isinstance(source, CheckpointConfig):
        return source.to_dict()
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        loaded = read_yaml(path)
        if loaded is None:
            return {}
        if not isinstance(loaded, Mapping):
            raise ConfigError(f"{str(path)!r} must hold a mapping of fastckpt settings, not {type(loaded).__name__}")
        return dict(loaded)
    raise ConfigError(f"a fastckpt config is a CheckpointConfig, a mapping, a YAML path or None; "
                      f"got {type(source).__name__}")


def _expand_user(root: str) -> str:
    """``~/ckpt`` and ``file://~/ckpt`` name the home directory, as in a shell (a URL is left alone)."""
    if root.startswith("file://"):
        return "file://" + os.path.expanduser(root.removeprefix("file://"))
    return os.path.expanduser(root) if "://" not in root else root


def _same_place(a: str, b: str) -> bool:
    return a.strip().rstrip("/") == b.strip().rstrip("/")


def _build_section(name: str, cls: type, data: Mapping[str, Any]) -> Any:
    allowed = {f.name for f in fields(cls)}
    unknown = sorted((k for k in data if k not in allowed), key=repr)
    if unknown:
        raise ConfigError(f"unknown field(s) {[f'{name}.{u}' for u in unknown]}"
                          f"{_did_you_mean(unknown, allowed, name + '.')}; allowed: {sorted(allowed)}")
    return cls(**dict(data))


def _did_you_mean(unknown: list[Any], allowed: set[str], prefix: str = "") -> str:
    """`` (did you mean 'retention.keep_last'?)`` for each unknown key close to an allowed one (a typo), else ``""``."""
    guesses = [f"{prefix}{match[0]}" for key in unknown if isinstance(key, str)
               for match in [difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=0.6)] if match]
    return f" (did you mean {', '.join(map(repr, guesses))}?)" if guesses else ""
