#!/usr/bin/env bash
# The one command for a bare GPU machine without network (README.md, "On a GPU"):
#   bash benchmarks/gpu.sh [--dry-run] [--tests "PYTEST ARGS"] [WHEELS_DIR] [OUT_DIR]
# WHEELS_DIR (default .whl, made beforehand by benchmarks/gpu_wheels.sh) holds the wheels the machine lacks;
# they go into OUT_DIR/.site with pip --no-index --no-deps --target, put first on PYTHONPATH with the repo.
# Steps, each time-boxed so the whole stays under 9 minutes and a failing step does not stop the later ones:
# environment -> CUDA tests (pytest -m cuda, junit xml) -> GPU benchmark -> GIL hand-overs -> FSDP checks -> pin probe
# -> summary. Results under OUT_DIR
# (default $OUT, else gpu_out), 8 files at most (what the device tool brings back): summary.md, env.txt,
# cuda_tests.xml, cuda_tests.txt, gpu_bench.json, gpu_bench.md, fsdp.json, logs.txt.
# --dry-run: this CPU machine; CUDA tests are collected and skipped with their reason, the benchmark runs
# tiny sizes on the CPU and labels itself a CPU fallback.
set -uo pipefail
DRY=0
TESTS="tests"
while [[ $# -gt 0 && "$1" == --* ]]; do
  case "$1" in
    --dry-run) DRY=1; shift ;;
    --tests) TESTS="$2"; shift 2 ;;
    *) echo "gpu.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
WHEELS="${1:-.whl}"
OUTD="${2:-${OUT:-gpu_out}}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO" || exit 2
mkdir -p "$OUTD"
OUTD="$(cd "$OUTD" && pwd)"
# The machine's own interpreter (it holds torch); python3 elsewhere.
PY=/opt/torch/.venv/bin/python3
[[ -x "$PY" ]] || PY="$(command -v python3)"
SITE="$(mktemp -d)"  # outside OUT_DIR: only results travel back
LOG="$OUTD/logs.txt"
: > "$LOG"
START=$SECONDS
summary() { echo "$1" | tee -a "$OUTD/summary.md"; }
: > "$OUTD/summary.md"
summary "# fastckpt GPU command ($([[ $DRY == 1 ]] && echo 'DRY RUN, CPU' || echo 'GPU'))"

# 1. wheels the machine lacks (benchmarks/gpu_wheels.sh), into a private folder: the image stays untouched.
PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ "$PYVER" != 3.12 ]]; then  # gpu_wheels.sh downloads cp312 wheels, the GPU machine's Python
  summary "- wheels: not installed (they are for Python 3.12; this python3 is $PYVER and has its own)"
elif compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl >> "$LOG" 2>&1 \
    && summary "- wheels: installed from $WHEELS" || summary "- wheels: install FAILED (see logs.txt)"
else
  summary "- wheels: none in $WHEELS (run benchmarks/gpu_wheels.sh where there is network)"
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# 2. environment: device, torch, CUDA, driver.
{
  echo "date: $(date -u +%FT%TZ)"
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda); print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)")'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: absent"
  echo "kernel $(uname -r); cpus $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # nproc obeys OMP_NUM_THREADS
  # staging.shm page-locks file-backed memory: where the kernel allows it (tmpfs yes, disk file systems not on newer kernels)
  "$PY" - /dev/shm /tmp "$REPO" <<'PYEOF'
import mmap, os, sys, tempfile, torch
if torch.cuda.is_available():
    torch.cuda.init()
    for d in sys.argv[1:]:
        fs = max((l.split()[:3] for l in open("/proc/mounts") if (d + "/").startswith(l.split()[1].rstrip("/") + "/")),
                 key=lambda m: len(m[1]))[2]
        fd, path = tempfile.mkstemp(dir=d)
        os.ftruncate(fd, 1 << 20)
        mm = mmap.mmap(fd, 1 << 20)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        err = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), 1 << 20, 1))
        if err == 0:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        print(f"cudaHostRegister of a file mapping in {d} ({fs}): error {err}")
        del buf; mm.close(); os.close(fd); os.unlink(path)
PYEOF
} > "$OUTD/env.txt" 2>&1
summary "- environment: $(tr '\n' ';' < "$OUTD/env.txt")"

step() {  # step NAME SECONDS LOG CMD...: CMD time-boxed, output to LOG; its status goes to the summary, never stops us
  local name="$1" limit="$2" log="$3"; shift 3
  # the dry run shares a CPU machine: its boxes are for hangs only (beside two CPU-bound processes the GIL step's two
  # runs took over its 45 s); the GPU machine's boxes keep the whole under 9 minutes
  [[ $DRY == 1 ]] && limit=$((limit * 3))
  local t0=$SECONDS
  echo "=== $name" >> "$log"
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  summary "- $name: rc=$rc$([[ $rc == 124 || $rc == 137 ]] && echo ' (TIMED OUT)') in $((SECONDS - t0)) s"
}

# 3. every CUDA test (marked @pytest.mark.cuda), junit xml + the skip reasons (-rs) in cuda_tests.txt.
# rc=5: no test carries the mark in this tree. A test module importing what the image lacks (s3fs, wandb)
# fails its own collection only (--continue-on-collection-errors), not the CUDA tests of the others.
step "CUDA tests (pytest -m cuda)" 200 "$OUTD/cuda_tests.txt" "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs --continue-on-collection-errors \
  --timeout 120 --junitxml "$OUTD/cuda_tests.xml" $TESTS
tail -n 3 "$OUTD/cuda_tests.txt" | sed 's/^/    /' | tee -a "$OUTD/summary.md"

# 4. the GPU benchmark (CPU fallback, tiny and labelled, in the dry run).
# checkpoints on the repo's disk (not /tmp, maybe tmpfs) and outside OUT_DIR: only results travel back
BENCH_ARGS=(--out "$OUTD" --work "$REPO/bench_out/gpu" --variants)
[[ $DRY == 1 ]] && BENCH_ARGS+=(--dry-run --every 3 --checkpoints 2)
step "GPU benchmark" 205 "$LOG" "$PY" -m benchmarks.gpu_bench "${BENCH_ARGS[@]}"
rm -rf "$REPO/bench_out/gpu"

# 4b. GIL hand-overs per checkpoint on the CUDA path (benchmarks/gilcalls.py --cuda; engine/cudacopy.py batches the
# copies): the live tensors, then a device snapshot. Its lines go into the summary (no file of its own: 8 at most).
GIL_ARGS=(--cuda --checkpoints 1)
[[ $DRY == 1 ]] && GIL_ARGS=(--quick --checkpoints 1)  # no GPU: the CPU path, to prove the step runs
GILOUT="$(mktemp)"
step "GIL hand-overs, CUDA path" 45 "$GILOUT" bash -c '"$0" -m benchmarks.gilcalls "$@" && "$0" -m benchmarks.gilcalls "$@" --config "{\"staging\": {\"device_snapshot\": \"on\"}}"' "$PY" "${GIL_ARGS[@]}"
grep '^checkpoint' "$GILOUT" | sed 's/^/    /' | tee -a "$OUTD/summary.md"
cat "$GILOUT" >> "$LOG"; rm -f "$GILOUT"

# 5. FSDP through fastckpt, resharded on load, against the stock save (world size 1, one GPU).
FSDP_ARGS=(--out "$OUTD")
[[ $DRY == 1 ]] && FSDP_ARGS+=(--dry-run)
step "FSDP checks" 80 "$LOG" "$PY" -m benchmarks.gpu_fsdp "${FSDP_ARGS[@]}"

"$PY" - "$OUTD/fsdp.json" <<'PYEOF' 2>/dev/null | tee -a "$OUTD/summary.md"
import json, sys
for name, r in json.load(open(sys.argv[1])).items():
    print(f"    {name}: {r}" if name == "device" else f"    {name}: {r['status']} {r.get('reason', '')[:300]}")
PYEOF
# 6. why the first checkpoint stalls: page-locking fresh buffers on another thread (benchmarks/gpu_pinprobe.py)
PROBE="$(mktemp -d)"
step "pin probe" 60 "$LOG" "$PY" -m benchmarks.gpu_pinprobe --out "$PROBE"
"$PY" -c 'import json, sys; [print(f"    {r}") for r in json.load(open(sys.argv[1]))]' "$PROBE/pinprobe.json" 2>/dev/null \
  | tee -a "$OUTD/summary.md"
rm -rf "$PROBE"

rm -rf "$SITE"
summary "- total: $((SECONDS - START)) s"
