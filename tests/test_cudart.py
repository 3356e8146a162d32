"""Which CUDA runtime fastckpt calls (fastckpt/cudart.py): torch's own, never merely the first ``libcudart`` by path.

A process may hold several runtimes (cupy, TensorRT beside torch); clearing the last error or creating a stream
through another one than torch's does nothing torch sees. Checked without a GPU: the lookup itself (``dlsym``
through torch's own library, then ``dladdr``) on the OpenMP runtime torch ships, with a second and a third copy
loaded beside it; and real ``libcudart`` files loaded beside a CPU-only torch, which has no runtime of its own to
call. Each case runs in a fresh interpreter: the libraries it loads stay out of the test process. The GPU
counterpart (torch's runtime found among two) is in test_cuda_device.py.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastckpt.cudart import pick_runtime

REPO = Path(__file__).resolve().parent.parent
TORCH_LIB = Path(torch.__file__).parent / "lib"


def _child(code: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_runtime_is_the_one_torchs_library_binds_not_the_first_by_path(tmp_path) -> None:
    own = TORCH_LIB / "libgomp.so.1"
    if not own.exists():
        pytest.skip(f"this torch build ships no {own.name} to stand in for its CUDA runtime")
    # copies of it loaded beside torch's own, as cupy's libcudart would be: one under a path sorting first
    first = Path("/dev/shm") / f"a-fastckpt-{os.getpid()}"
    first.mkdir(exist_ok=True)
    try:
        shutil.copy(own, first / own.name)
        shutil.copy(own, tmp_path / own.name)
        got = _child("""
            import ctypes, json, sys
            import torch
            from fastckpt.cudart import mapped_libraries, torch_library
            for path in sys.argv[1:]:
                ctypes.CDLL(path)  # RTLD_LOCAL, by path: a second copy of the same library, as a framework loads one
            loaded = sorted(p for p in mapped_libraries() if "libgomp" in p)
            print(json.dumps({"loaded": loaded,
                              "picked": torch_library("libgomp", ("libtorch_cpu.so",), "omp_get_num_threads")}))
        """, str(first / own.name), str(tmp_path / own.name))
    finally:
        shutil.rmtree(first)
    mine = os.path.realpath(own)
    assert len(got["loaded"]) == 3 and got["loaded"][0] != mine, got  # what "the first by path" would have taken
    assert got["picked"] == mine


def test_several_runtimes_and_none_of_them_torchs_is_none() -> None:
    found = sorted(glob.glob("/usr/local/cuda*/lib*/libcudart.so.*") + glob.glob("/usr/lib*/*/libcudart.so.*"))
    if torch.version.cuda is not None or not found:
        pytest.skip("needs a libcudart file to load beside a CPU-only torch build (none here, or torch has its own)")
    got = _child("""
        import ctypes, json, os, shutil, sys, tempfile
        import torch
        from fastckpt.cudart import loaded_cudart, mapped_libraries
        src = sys.argv[1]
        ctypes.CDLL(src)
        one = loaded_cudart()  # the only runtime loaded: nothing to tell apart, it is called
        folder = tempfile.mkdtemp()
        copy = shutil.copy(src, os.path.join(folder, os.path.basename(src)))
        ctypes.CDLL(copy)  # a second one (another framework's): which is torch's? neither; never guess
        two = loaded_cudart()
        shutil.rmtree(folder)
        print(json.dumps({"one": None if one is None else os.path.realpath(one._name), "two": two is None,
                          "loaded": len([p for p in mapped_libraries() if "libcudart" in p])}))
    """, found[0])
    assert got == {"one": os.path.realpath(found[0]), "two": True, "loaded": 2}


def test_which_runtime_is_called() -> None:
    a, b = "/opt/cupy/libcudart.so.12", "/site/torch/lib/libcudart.so.12"
    assert pick_runtime([a, b], b, asked=True) == b  # torch's own, found among others
    assert pick_runtime([a, b], "/site/torch/lib/libtorch_cuda.so", asked=True) is None  # torch's runtime is static
    assert pick_runtime([a], None, asked=False) == a  # unasked: a lone runtime is called...
    assert pick_runtime([a, b], None, asked=False) is None  # ...never one of several
