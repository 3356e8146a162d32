"""Training processes for the shared-memory tier's crash tests, run from a forkserver.

The forkserver imports torch and fastckpt once; every trial's process is then a cheap
fork of it, SIGKILLed by the test at a moment it picks from what the child reported
through its pipe. Each function here runs in such a child (possibly as one of two gloo
ranks) and reports every step whose ``wait_staged()`` returned.
"""
from __future__ import annotations

import glob
import logging
import multiprocessing as mp
import os
import socket
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer, FastCkptError
from fastckpt.storage.local import LocalStorage
from tests import threaddump
from tests.helpers import assert_bit_equal, clone_state

_CTX: Any = None
REPLY_S = 120.0  # a safety net only: every wait below is on a pipe message


def context() -> Any:
    """The forkserver context, preloading this module (and so torch and fastckpt) once."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload([__name__])
    return _CTX


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(root: str, shm: str, **staging: Any) -> CheckpointConfig:
    return CheckpointConfig(root=root, staging={"shm": True, "shm_dir": shm, **staging},
                            persist={"chunk_bytes": 4096, "fsync": False})


class StuckStorage(LocalStorage):
    """Local storage whose writes for checkpoints at step >= ``stuck_at`` never finish (a hung disk)."""

    def __init__(self, root: str, stuck_at: int) -> None:
        super().__init__(root, fsync=False)
        self.stuck_at = stuck_at

    def write_file(self, path: str, parts: Any) -> None:
        step = _step_of(path)
        if step is not None and step >= self.stuck_at:
            threading.Event().wait()
        super().write_file(path, parts)


def _step_of(path: str) -> int | None:
    for part in path.split(os.sep):
        if part.startswith("step-") and part[5:].isdigit():
            return int(part[5:])
    return None


# ---- the state: every value is a function of the step, so any process can rebuild it ----------

def model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16))
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def set_step(m: nn.Module, step: int) -> None:
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 0.001 + step * 10 + i)


def state(m: nn.Module, step: int) -> dict[str, Any]:
    return {"model": m.state_dict(), "eager": torch.full((300,), float(step)), "step": step, "tag": f"s{step}"}


def expected(step: int) -> dict[str, Any]:
    m, _ = model()
    set_step(m, step)
    return clone_state(state(m, step))


def check_committed(ck: Checkpointer, must: list[int]) -> list[int]:
    """Every committed checkpoint is bit-exact for its step, and each of ``must`` is committed."""
    steps = [i.step for i in ck.list()]
    missing = sorted(set(must) - set(steps))
    assert not missing, f"steps {missing} were staged (wait_staged returned) but not committed; have {steps}"
    for s in steps:
        assert_bit_equal(expected(s), ck.load(step=s))
    return steps


# ---- the children ------------------------------------------------------------------------

def train(conn: Connection, root: str, shm: str, steps: int, stuck_at: int, rank: int = 0, world: int = 1,
          port: int = 0, durable_first: bool = False) -> None:
    """Save steps 1..steps, reporting each once staged; mutate the watched tensors right after. ``durable_first``:
    the steps before ``stuck_at`` are reported once committed (a test that needs them on disk before the kill)."""
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    ck = Checkpointer(config(root, shm), storage=StuckStorage(root, stuck_at), distributed=world > 1)
    m, opt = model()
    ck.watch(opt)
    for step in range(1, steps + 1):
        set_step(m, step)
        handle = ck.save(state(m, step), step=step)
        handle.wait() if durable_first and step < stuck_at else handle.wait_staged()
        conn.send(step)
        with torch.no_grad():  # what the optimizer would do: the snapshot must not see it
            for p in m.parameters():
                p.add_(1000.0)
    conn.send("done")
    threading.Event().wait()  # wait for the SIGKILL


def two_in_one_process(conn: Connection, root: str, shm: str) -> None:
    """Two Checkpointers in one process sharing one shm_dir (roots ``root/run1``, ``root/run2``: one root has one
    writer, the root lock sees to that), each with a staged snapshot that never commits."""
    handles = []
    for step in (1, 2):
        where = os.path.join(root, f"run{step}")
        ck = Checkpointer(config(where, shm), storage=StuckStorage(where, 0))
        m, _ = model()
        set_step(m, step)
        ck.save(state(m, step), step=step).wait_staged()
        handles.append(ck)
    conn.send("staged")
    threading.Event().wait()


def fill_shm(conn: Connection, root: str, shm: str) -> None:
    """Save a small state, then one that does not fit the tmpfs; report what save() raised."""
    try:
        with Checkpointer(config(root, shm)) as ck:
            m, _ = model()
            set_step(m, 1)
            ck.save(state(m, 1), step=1).wait()
            try:
                ck.save({"big": torch.ones(1 << 20)}, step=2)  # 4 MiB in a 1 MiB tmpfs
                outcome = ("saved", "")
            except FastCkptError as e:
                outcome = (type(e).__name__, str(e))
            check_committed(ck, [1])  # the previous good checkpoint is untouched
            assert ck.latest() == 1
        conn.send(outcome)
    except BaseException:  # noqa: BLE001 - the parent shows it
        conn.send(("error", traceback.format_exc()))


def fill_shm_lazily(conn: Connection, root: str, shm: str) -> None:
    """Save a small watched state, then a watched one that does not fit the tmpfs: its buffers are made on the copy
    thread, so save() returns and the failure comes at the next call, once. Report what save(), that next call and
    the one after raised, and the buffer files left."""
    try:
        with Checkpointer(config(root, shm)) as ck:
            m, opt = model()
            ck.watch(opt)
            set_step(m, 1)
            ck.save(state(m, 1), step=1).wait()
            big = nn.Linear(1024, 1024, bias=False)  # 4 MiB of lazily copied weights in a 1 MiB tmpfs
            big_opt = torch.optim.SGD(big.parameters(), lr=0.1)  # watched weakly: kept alive here
            ck.watch(big_opt)
            outcome = []
            try:
                h = ck.save({"big": big.state_dict()}, step=2)
                outcome.append("returned")
                h.wait_staged()  # the optimizer's pre-hook: the copy thread has failed by now, and the seal passed
                done = threading.Event()
                h.add_done_callback(lambda _: done.set())
                done.wait(60)
            except FastCkptError as e:
                outcome.append(f"save raised {type(e).__name__}")
            for _ in range(2):
                try:
                    ck.wait()
                    outcome.append("wait ok")
                except FastCkptError as e:
                    outcome.append(f"{type(e).__name__}: {e}")
            check_committed(ck, [1])  # the previous good checkpoint is untouched
            assert ck.latest() == 1
            outcome.append(sorted({os.path.basename(os.path.dirname(p)) for p in glob.glob(f"{shm}/**/*.bin",
                                                                                       recursive=True)}))
        conn.send(("ok", outcome))
    except BaseException:  # noqa: BLE001 - the parent shows it
        conn.send(("error", traceback.format_exc()))


def recover(conn: Connection, root: str, shm: str, must: list[int], rank: int, world: int, port: int) -> None:
    """A new rank after the crash: report the recovered and committed steps (each checked bit for bit)
    and the warnings logged."""
    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("fastckpt").addHandler(handler)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        with Checkpointer(config(root, shm), distributed=True) as ck:
            recovered = [h.step for h in ck.recovered]
            committed = check_committed(ck, must)
        dist.destroy_process_group()
        conn.send(("ok", recovered, committed, warnings))
    except BaseException:  # noqa: BLE001 - the parent shows it
        conn.send(("error", traceback.format_exc(), [], warnings))


# ---- the parent's side ----------------------------------------------------------------------

def _stack_file(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"fastckpt-child-{pid}.stack")


def _traced(fn: Callable[..., None], *args: Any) -> None:
    """The child's entry: SIGUSR1 dumps every thread's stack to a file the parent reads when the child is silent."""
    with open(_stack_file(os.getpid()), "w") as f:
        threaddump.arm(f)
        fn(*args)
    os.remove(f.name)  # a child killed by the test leaves it: kill() removes it


def start(fn: Callable[..., None], *args: Any) -> tuple[Any, Connection]:
    """Run ``fn(conn, *args)`` in a forked child; returns the process and the parent's end of the pipe."""
    ctx = context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_traced, args=(fn, child, *args), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def receive(proc: Any, conn: Connection) -> Any:
    """The child's next message; fails naming the exit code if it died instead."""
    if not conn.poll(REPLY_S):
        raise AssertionError(f"child {proc.pid} sent nothing in {REPLY_S}s (alive: {proc.is_alive()}); its "
                             f"threads:\n{_stacks(proc)}")
    try:
        return conn.recv()
    except EOFError:
        proc.join(REPLY_S)
        raise AssertionError(f"child {proc.pid} died (exit code {proc.exitcode})") from None


def _stacks(proc: Any) -> str:
    """A silent child's threads (faulthandler, on SIGUSR1), so that a hang names where it waits."""
    path = _stack_file(proc.pid)
    if not proc.is_alive() or not os.path.exists(path):
        return "(none)"
    threaddump.request([proc.pid])
    with open(path) as f:
        return f.read()


def kill(*procs: Any) -> None:
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.join(REPLY_S)
        if os.path.exists(_stack_file(proc.pid)):
            os.remove(_stack_file(proc.pid))


# The first optimizer built in a process imports torch._dynamo (seconds): pay that once, in the
# forkserver that preloads this module, rather than in every forked trial.
model()


def save_committed(conn: Connection, root: str, shm: str, steps: int) -> None:
    """Save steps 1..steps, reporting each once committed (its snapshot stays in shared memory)."""
    ck = Checkpointer(config(root, shm))
    m, _ = model()
    for step in range(1, steps + 1):
        set_step(m, step)
        ck.save(state(m, step), step=step).wait()
        conn.send(step)
    threading.Event().wait()  # wait for the SIGKILL
