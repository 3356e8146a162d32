"""Issue 24's CUDA findings on a real device: load_into right after save(), Lightning's resume placement,
record_stream on a dropped temporary, awkward tensors, fork after CUDA init with pinned buffers, a failed
cudaHostRegister. Every restore is compared bit for bit. The CPU-side checks are in test_cuda_paths.py.

Races are widened with ``torch.cuda._sleep`` (as in test_cuda.py) on the stream whose work must come second,
so a missing wait fails the comparison instead of being hidden by timing.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from fastckpt import CheckpointConfig, Checkpointer
from fastckpt.errors import FastCkptError
from tests.helpers import assert_bit_equal, clone_state

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

SLEEP = 1_000_000_000  # GPU clock cycles: some hundreds of milliseconds, far longer than any copy below


def _host(state: dict) -> dict:
    return {k: v.detach().resolve_conj().resolve_neg().cpu().clone() for k, v in state.items()}


def test_load_into_right_after_save_leaves_the_pending_lazy_copy_its_values(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(256, 256).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.watch(opt)  # the parameters are copied lazily
        state = {"m": model.state_dict()}
        old = clone_state(state)
        ckpt.save(state, step=0).wait(timeout=60)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3)
        new = clone_state(state)
        torch.cuda._sleep(SLEEP)  # the lazy copy of step 1 queues behind this
        h = ckpt.save(state, step=1)
        ckpt.load_into(state, step=0)  # must not overwrite the parameters before that copy read them
        h.wait(timeout=60)
        assert_bit_equal(new, ckpt.load(step=1))
        torch.cuda.synchronize()
        assert_bit_equal(old, {"m": model.state_dict()})
        assert all(v.is_cuda for v in model.state_dict().values())


def test_lightning_resume_of_a_gpu_checkpoint_lands_on_the_cpu(tmp_path) -> None:
    """Fails on one GPU too: without map_location the storages went back to cuda:0 (every DDP rank's, there)."""
    from fastckpt_lightning import FastCheckpointIO

    torch.manual_seed(0)
    state = {"state_dict": {"w": torch.randn(128, 64, device="cuda"), "n": torch.arange(7, device="cuda")}}
    path = str(tmp_path / "epoch=0-step=1.ckpt")
    plugin = FastCheckpointIO()
    try:
        plugin.save_checkpoint(state, path)
        plugin.wait_staged()
        loaded = plugin.load_checkpoint(path)  # the Trainer's resume call: map_location=None
    finally:
        plugin.teardown()
    assert {str(t.device) for t in loaded["state_dict"].values()} == {"cpu"}
    assert_bit_equal(_host(state["state_dict"]), loaded["state_dict"])


def test_a_dropped_temporary_is_not_reused_before_its_copy(tmp_path) -> None:
    """record_stream: the caching allocator must not hand the temporary's block to a new tensor while the copy
    stream still has to read it."""
    n = 1 << 20
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        tmp = torch.full((n,), 1.5, device="cuda")
        ref = tmp.cpu()
        ckpt.save({"warm": torch.zeros(1, device="cuda")}, step=0).wait(timeout=60)  # makes the copy streams
        busy = ckpt._saver._streams.eager(torch.cuda.current_device())  # the stream save() copies on
        with torch.cuda.stream(busy):
            torch.cuda._sleep(SLEEP)  # the eager copy queues behind this; the fill below does not
        h = ckpt.save({"t": tmp}, step=1)
        del tmp
        junk = torch.full((n,), -7.0, device="cuda")  # the allocator's first pick: the block just freed
        h.wait(timeout=60)
        assert_bit_equal({"t": ref}, ckpt.load(step=1))
        assert junk[0].item() == -7.0


def test_zero_size_complex_bool_and_expanded_tensors(tmp_path) -> None:
    torch.manual_seed(0)
    state = {
        "zero": torch.empty(0, 3, device="cuda"),
        "complex": torch.randn(33, dtype=torch.complex128, device="cuda"),
        "bool": torch.randn(1001, device="cuda") > 0,
        "expanded": torch.randn(3, 1, device="cuda").expand(3, 5),
    }
    ref = _host(state)
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        ckpt.save(state, step=1).wait(timeout=60)
        assert_bit_equal(ref, _host(ckpt.load(step=1)))
        on_gpu = ckpt.load(step=1, map_location="cuda")
        assert all(v.is_cuda for v in on_gpu.values())
        assert_bit_equal(ref, _host(on_gpu))
        target = {k: torch.zeros(v.shape, dtype=v.dtype, device="cuda") for k, v in ref.items()}
        ckpt.load_into(target, step=1)
        torch.cuda.synchronize()
        assert_bit_equal(ref, _host(target))


_FORK_CHILD = textwrap.dedent("""
    import os, sys
    import torch
    from fastckpt import CheckpointConfig, Checkpointer

    torch.manual_seed(0)
    state = {"w": torch.randn(4096, device="cuda")}
    ref = state["w"].cpu()
    ckpt = Checkpointer(CheckpointConfig(root=sys.argv[1]))  # staging buffers are page-locked for CUDA
    ckpt.save(state, step=1).wait(timeout=60)
    pid = os.fork()
    if pid == 0:  # the child inherits the pinned buffers and the Checkpointer, not the CUDA context
        import gc
        del ckpt
        gc.collect()  # unregistering them here must neither raise nor hang
        # as multiprocessing's fork children (DataLoader workers) end: no interpreter teardown, which would free
        # the parent's CUDA tensors here (torch aborts on a freed block that has stream uses: record_stream)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    ckpt.save(state, step=2).wait(timeout=60)
    got = ckpt.load(step=2)["w"]
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), "step 2 restored different bits"
    ckpt.close()
    print("OK")
""")


def test_fork_after_cuda_init_with_pinned_buffers(tmp_path) -> None:
    # Not helpers.run_child: its RLIMIT_AS is far below the address space a CUDA context reserves.
    # the repository first, then what the caller had (gpu.sh puts the wheels the machine lacks there)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")) if p)}
    try:
        out = subprocess.run([sys.executable, "-c", _FORK_CHILD, str(tmp_path)], env=env, capture_output=True,
                             text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"fork after CUDA init hung (stdout {e.stdout!r}, stderr {e.stderr!r})")
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr


def test_a_failed_host_registration_raises_and_leaves_no_stale_cuda_error(tmp_path, monkeypatch) -> None:
    real = torch.cuda.cudart()

    def register_twice(ptr: int, size: int, flags: int) -> int:
        assert int(real.cudaHostRegister(ptr, size, flags)) == 0
        err = int(real.cudaHostRegister(ptr, size, flags))  # fails for real (already registered): sets the last error
        real.cudaHostUnregister(ptr)
        return err

    failing = types.SimpleNamespace(cudaHostRegister=register_twice, cudaHostUnregister=real.cudaHostUnregister)
    torch.manual_seed(0)
    state = {"w": torch.randn(10_000, device="cuda")}
    with Checkpointer(CheckpointConfig(root=str(tmp_path))) as ckpt:
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "cudart", lambda: failing)
            with pytest.raises(FastCkptError, match="cannot page-lock"):
                ckpt.save(state, step=1)
        x = torch.ones(1000, device="cuda")
        x.add_(1)  # a kernel launch check: it raised the registration's stale error before
        torch.cuda.synchronize()
        assert torch.equal(x.cpu(), torch.full((1000,), 2.0))
        ckpt.save(state, step=2).wait(timeout=60)
        assert_bit_equal(_host(state), ckpt.load(step=2))


def test_dtensor_load_into_cuda_targets_lands_after_the_callers_stream(tmp_path) -> None:
    """Issue 54 item 11: the distributed/DTensor path of load_into (an FSDP2 resume) copied on the load worker
    threads' legacy default stream, which a non-blocking caller stream (FSDP's, a training loop's own) neither waits
    for nor makes wait: the fill queued below ran after the copies and the targets ended at -5."""
    from tests.dist_launcher import run_ranks
    from tests.test_cuda_paths import _dtensor_state, _save_dtensors

    run_ranks(_save_dtensors, 1, str(tmp_path))  # DTensor blocks, one file each (a 1-rank gloo mesh on the CPU)
    ref = _dtensor_state()
    caller = torch.cuda.Stream()  # non-blocking, as torch makes every stream but the legacy default one
    with Checkpointer(CheckpointConfig(root=str(tmp_path), persist={"workers": 4})) as ckpt:
        target = {k: torch.zeros(v.shape, dtype=v.dtype, device="cuda") for k, v in ref.items()}
        torch.cuda.synchronize()
        with torch.cuda.stream(caller):
            torch.cuda._sleep(SLEEP)
            for t in target.values():
                t.fill_(-5.0)  # queued before load_into on the caller's stream: the loaded values must land after
            ckpt.load_into(target, step=1)
            seen = {k: v.clone() for k, v in target.items()}  # the caller's next kernel: after the loaded values
        torch.cuda.synchronize()
    assert_bit_equal(ref, _host(target))
    assert_bit_equal(ref, _host(seen))


_TWO_RUNTIMES = textwrap.dedent("""
    import ctypes, json, os, shutil, sys
    import torch
    from fastckpt.cudart import dedicated_stream, loaded_cudart, mapped_libraries, symbol_file

    torch.cuda.init()
    owner = next(p for p in mapped_libraries() if os.path.basename(p) in ("libc10_cuda.so", "libtorch_cuda.so"))
    own = symbol_file(owner, "cudaGetLastError")  # the file torch's CUDA library takes the runtime from
    runtimes = [p for p in mapped_libraries() if "libcudart" in os.path.basename(p)]
    other = None
    for folder in sys.argv[1:] if runtimes else ():  # a second runtime, as cupy or TensorRT load one
        try:  # under a path that sorts first (/dev/shm), where its mount lets a library load from it
            other = shutil.copy(runtimes[0], os.path.join(folder, os.path.basename(runtimes[0])))
            ctypes.CDLL(other)
            break
        except OSError:
            other = None
    lib = loaded_cudart()
    x = torch.arange(1 << 20, dtype=torch.float32)
    stream = dedicated_stream(0, 0)
    with torch.cuda.stream(stream):
        y = x.cuda(non_blocking=False)
    stream.synchronize()
    print(json.dumps({"own": own, "picked": None if lib is None else os.path.realpath(lib._name),
                      "loaded": sorted(p for p in mapped_libraries() if "libcudart" in os.path.basename(p)),
                      "error": None if lib is None else int(lib.cudaGetLastError()),
                      "exact": bool(torch.equal(y.cpu(), x)), "other": other}))
""")


def test_torchs_own_runtime_is_called_with_another_one_loaded_beside_it(tmp_path) -> None:
    """Issue 54 item 11: loaded_cudart took the first libcudart by sorted path, with a second runtime loaded as
    likely another framework's as torch's (here: a copy under /dev/shm, which sorts before torch's own)."""
    import json
    import shutil
    import tempfile

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")) if p)}
    first = tempfile.mkdtemp(prefix="a", dir="/dev/shm")
    try:
        out = subprocess.run([sys.executable, "-c", _TWO_RUNTIMES, first, str(tmp_path)], env=env,
                             capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(first, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["exact"], got  # a copy on fastckpt's own stream, made through the runtime picked
    if got["own"] not in got["loaded"]:  # torch links its runtime statically: none of the loaded ones is torch's
        assert got["picked"] is None, f"a runtime torch does not call was picked: {got}"
        return
    assert got["other"] is not None and len(got["loaded"]) == 2, got
    assert got["picked"] == got["own"] and got["error"] == 0, got  # the old rule took loaded[0] when it sorts first
