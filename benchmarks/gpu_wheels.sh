#!/usr/bin/env bash
# Download the wheels the GPU machine lacks into a folder (default .whl/, ignored by git), on a machine
# with network, for `bash benchmarks/gpu.sh WHEELS_DIR OUT_DIR` there (no network on the GPU machine).
# The GPU image already has torch, lightning, accelerate, safetensors, fsspec, pyyaml, psutil, numpy,
# pytest, pytest-timeout (benchmarks/gpu_machine_packages.txt); only these are missing. Versions are the
# ones this project's venv is tested with. tests/test_gpu_command.py checks that every hard third-party
# import of the package is either on the machine or in WHEELS below, so this list cannot rot unseen.
set -euo pipefail
DEST="${1:-.whl}"
# One "distribution==version" a line; parsed by tests/test_gpu_command.py.
WHEELS=(
  crc32c==2.9.post0
  zlib-ng==1.1.0
  torch-checkpointing==0.1.1  # a benchmark peer only (benchmarks/gpu_bench.py); pure Python, needs torch>=2.11
)
mkdir -p "$DEST"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"
