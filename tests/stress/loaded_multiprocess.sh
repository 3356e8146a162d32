#!/usr/bin/env bash
# Run every multi-process test file N times on a machine loaded by two CPU-bound burners (issue 22.17).
#
# Usage (from the repository root, venv active):  tests/stress/loaded_multiprocess.sh [RUNS] [RESULTS]
#   RUNS     passes over the files (default 20)
#   RESULTS  a file of "run file PASS|FAIL seconds commit" lines (default tests/stress/loaded-mp-results.txt, kept in
#            the repository: the passes span sessions, and the record of them is the evidence for issue 22.17)
# Resumable: a (run, file) pair already in RESULTS is skipped, so a stopped loop goes on where it was; a pass that was
# stopped midway is finished by the next call (at the commit then checked out: each line names its own).
# A failing file's pytest output is kept as RESULTS.run<N>.<file>.log (it holds every rank's output).
# The burners are started here and killed, by pid, on any exit (trap).
set -u
RUNS=${1:-20}
RESULTS=${2:-tests/stress/loaded-mp-results.txt}
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
FILES=(
  tests/test_rank_logs.py tests/test_distributed.py tests/test_dtensor.py tests/test_dtensor_uneven.py
  tests/test_shared_file.py tests/test_lifecycle_safety.py tests/test_remote_tier.py tests/test_shm_crash_trials.py
  tests/test_accelerate_collectives.py tests/test_accelerate_resume.py tests/test_examples.py
  tests/test_lightning_ddp.py tests/test_lightning_ddp_shared.py tests/test_lightning_sharded.py
  tests/test_s3_shared_object.py tests/test_lightning_ddp_s3.py tests/test_accelerate_s3_shared.py
  tests/test_s3_shared_dedup.py tests/test_persister.py tests/test_preempt.py tests/test_accelerate_s3_dedup.py
  tests/test_accelerate_remote_dedup.py tests/test_priority.py tests/test_seal_distributed.py
)
touch "$RESULTS"
BURNERS=()
for _ in 1 2; do python -c "while True: pass" & BURNERS+=($!); done
trap 'kill "${BURNERS[@]}" 2>/dev/null' EXIT
export PYTHONPATH=$PWD
for run in $(seq 1 "$RUNS"); do
  for f in "${FILES[@]}"; do
    grep -q "^$run $f " "$RESULTS" && continue
    start=$(date +%s)
    log="$RESULTS.run$run.$(basename "$f" .py).log"
    if timeout 1800 python -m pytest -q -p no:cacheprovider "$f" >"$log" 2>&1; then
      verdict=PASS; rm -f "$log"
    else
      verdict=FAIL
    fi
    echo "$run $f $verdict $(( $(date +%s) - start )) $COMMIT" | tee -a "$RESULTS"
  done
done
echo "passed: $(grep -c ' PASS ' "$RESULTS")  failed: $(grep -c ' FAIL ' "$RESULTS")"
