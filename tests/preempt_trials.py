"""Preemption trials: a child trains, gets SIGTERM at a random step, then SIGKILL after ``grace_s``; the newest
committed checkpoint must be the state the child recorded at the signal, bit for bit (docs/API.md, "Flush on
preemption"). Used by tests/test_preempt*.py and, by hand, ``python tests/preempt_trials.py plain 30``.

Children come from a forkserver that imported torch (and Lightning, Accelerate) once, so a trial costs a fork,
not an interpreter start. The parent synchronizes on what the child sends through a pipe, never on sleeps.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import resource
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CHILD_AS_BYTES = 8 << 30
STEP_TIMEOUT_S = 60.0  # a safety net for a child that hangs: a step takes milliseconds
SAVE_EVERY = 4


@dataclass
class Trial:
    """What one trial saw."""

    signal_after: int  # the step the child had reported when SIGTERM was sent
    exitcode: int | None
    recorded_step: int | None  # the step the child recorded at the signal (None: it never reached a safe point)
    latest: int | None  # the newest committed step afterwards
    exact: bool  # the newest committed checkpoint equals the recorded state, bit for bit
    killed: bool  # SIGKILL was needed after grace_s


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _record(root: Path, state: Any, step: int) -> None:
    """The state at the signal, as the child saw it, written with plain torch.save (temp + rename)."""
    tmp = root.parent / "recorded.tmp"
    torch.save({"step": step, "state": state}, tmp)
    os.replace(tmp, root.parent / "recorded.pt")


def _config(root: Path, grace_s: float, shm_dir: str | None) -> Any:
    from fastckpt import CheckpointConfig

    staging = {"shm": True, "shm_dir": shm_dir} if shm_dir else {}
    return CheckpointConfig.from_dict({"root": str(root), "staging": staging, "persist": {"fsync": False},
                                       "preemption": {"enabled": True, "grace_s": grace_s}})


class _BlockAfterSignal:
    """A storage whose data writes block once the final checkpoint began (a storage that stalls at the worst
    moment): only the shared-memory copy of the final snapshot exists when SIGKILL comes."""

    def __init__(self, inner: Any, conn: Any, shm_dir: str) -> None:
        self.inner, self.url, self.conn, self.shm_dir = inner, inner.url, conn, shm_dir
        self.blocked = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def write_file(self, path: str, parts: Any) -> None:
        # Only the final snapshot's writes stall: an earlier save committing at the same moment (its commit waits for
        # its seal, at this very step's pre-hook) must not send "stalled" before the final snapshot is staged.
        if self.blocked and "-preempt" in path:
            # A shard is written as soon as it is staged, which can be before the snapshot's shared-memory record
            # is in place (written once the whole snapshot is staged): SIGKILL only once it is recoverable.
            _until_recorded(self.shm_dir, "-preempt")
            self.conn.send(("stalled", None))
            threading.Event().wait()  # until SIGKILL
        self.inner.write_file(path, parts)

    def write_atomic(self, path: str, data: bytes) -> None:
        self.inner.write_atomic(path, data)


def _until_recorded(shm_dir: str, marker: str, timeout_s: float = 60.0) -> None:
    """Wait until a shared-memory record (``staged.json``) of a snapshot whose name holds ``marker`` exists under
    ``shm_dir``: the record is renamed into place whole, so a process started after a SIGKILL recovers it."""
    from fastckpt.format.shm_record import RECORD

    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while time.monotonic() < deadline:
        for rec in Path(shm_dir).rglob(RECORD):
            try:
                if marker in rec.read_text():
                    return
            except OSError:
                continue  # renamed or removed meanwhile
        tick.wait(0.005)
    raise RuntimeError(f"no shared-memory record of a {marker!r} snapshot under {shm_dir} within {timeout_s}s")


def plain_child(root: str, grace_s: float, shm_dir: str | None, conn: Any) -> None:
    """The plain API: a loop saving every SAVE_EVERY steps, ``on_preempt`` returning the live state."""
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_AS_BYTES, CHILD_AS_BYTES))
    from fastckpt import Checkpointer
    from fastckpt.storage.protocol import open_storage

    path = Path(root)
    storage = None
    if shm_dir:
        storage = _BlockAfterSignal(open_storage(str(path), {}, fsync=False), conn, shm_dir)
    ckpt = Checkpointer(_config(path, grace_s, shm_dir), storage=storage)
    model, opt = _model()
    ckpt.watch(opt)
    step = 0

    def at_signal() -> tuple[Any, int]:
        state = _state(model, opt)
        _record(path, state, step)
        conn.send(("recorded", step))
        if storage is not None:
            storage.blocked = True
        return state, step

    ckpt.preemption.on_preempt(at_signal)
    gen = torch.Generator().manual_seed(1)
    while True:
        x = torch.randn(16, 32, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()  # the safe point: the pre-hook takes the final checkpoint, then the signal kills us
        step += 1
        if step % SAVE_EVERY == 0:
            ckpt.save(_state(model, opt), step)
        conn.send(("step", step))


CHILDREN = {"plain": plain_child}
JUDGES: dict[str, Any] = {}  # kind -> judge(root, seen, exitcode, recorded, killed) for the other front-ends
PRELOAD: list[str] = []  # what the other front-ends' children import (tests/preempt_frontends.py adds them)


def run_trial(kind: str, root: Path, *, grace_s: float = 20.0, shm_dir: str | None = None,
              rng: random.Random | None = None, ctx: Any = None) -> Trial:
    """One trial: SIGTERM after a random step in 1..24, SIGKILL once ``grace_s`` passed (or once the child says
    its storage stalled, with ``shm_dir``), then the newest committed checkpoint compared with the recorded state."""
    rng = rng or random.Random()
    ctx = ctx or context()
    root.mkdir(parents=True, exist_ok=True)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=CHILDREN[kind], args=(str(root), grace_s, shm_dir, child), daemon=True)
    proc.start()
    child.close()
    target, seen, recorded = rng.randint(1, 24), 0, None
    try:
        while seen < target:
            if not parent.poll(STEP_TIMEOUT_S):
                raise TimeoutError(f"the {kind} child sent nothing for {STEP_TIMEOUT_S}s (exit {proc.exitcode})")
            try:
                what, value = parent.recv()
            except EOFError:
                raise RuntimeError(f"the {kind} child died before the signal (exit {proc.exitcode})") from None
            if what == "step":
                seen = value
        os.kill(proc.pid, signal.SIGTERM)
        killed = False
        while True:  # until the child exits, or grace_s passed (or its storage stalled: shm trials)
            if not parent.poll(grace_s):
                break
            try:
                what, value = parent.recv()
            except EOFError:
                break
            if what == "recorded":
                recorded = value
            elif what == "stalled":
                break
        proc.join(0 if shm_dir else grace_s)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            killed = True
        proc.join(STEP_TIMEOUT_S)
    finally:
        if proc.is_alive():
            proc.kill()
        parent.close()
    if kind in JUDGES:
        return JUDGES[kind](root, seen, proc.exitcode, recorded, killed)
    return _judge(kind, root, shm_dir, seen, proc.exitcode, recorded, killed)


def _judge(kind: str, root: Path, shm_dir: str | None, seen: int, exitcode: int | None, recorded: int | None,
           killed: bool) -> Trial:
    from fastckpt import CheckpointConfig, Checkpointer
    from tests.helpers import assert_bit_equal

    staging = {"shm": True, "shm_dir": shm_dir} if shm_dir else {}
    with Checkpointer(CheckpointConfig.from_dict({"root": str(root), "staging": staging})) as ckpt:
        ckpt.wait()  # with shm: the snapshot recovered from shared memory commits now
        latest = ckpt.latest()
        exact = False
        rec = root.parent / "recorded.pt"
        if recorded is not None and latest == recorded and rec.exists():
            want = torch.load(rec, weights_only=True)["state"]
            try:
                assert_bit_equal(ckpt.load(), want)
                exact = True
            except AssertionError:
                exact = False
    return Trial(seen, exitcode, recorded, latest, exact, killed)


def context() -> Any:
    """A forkserver that imported torch and fastckpt once: each child is a fork of it."""
    ctx = mp.get_context("forkserver")
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    ctx.set_forkserver_preload(["torch", "fastckpt", "tests.preempt_trials", *PRELOAD])
    return ctx


def main(argv: list[str]) -> int:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests import preempt_frontends  # noqa: F401 - registers the other front-ends' children
    from tests import preempt_trials as trials  # children pickle their target by this module's name

    kind, n = argv[0], int(argv[1])
    rng = random.Random(int(argv[2]) if len(argv) > 2 else None)
    ok = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(n):
            t = trials.run_trial(kind, Path(tmp) / f"t{i}" / "root", rng=rng)
            good = t.exact and t.latest == t.recorded_step
            ok += good
            print(f"trial {i}: {t}{'' if good else '  <-- FAILED'}", flush=True)
    print(f"{kind}: {ok}/{n} trials: the newest committed checkpoint is the state at the signal, bit-exact")
    return 0 if ok == n else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
