#!/usr/bin/env bash
# The accelerator check of issue #30 on a bare GPU machine whose python3 has
# JAX with CUDA, PyTorch with CUDA and Triton. Keras and what else is
# missing travel as wheels in .whl/ (git-ignored; see docs/guides/devices.md).
#
#   OUT=results_dir bash scripts/device_check.sh
#
# Four stages, each in its own process under its own time limit (seconds,
# overridable): JAX correctness, torch correctness, JAX timings, torch
# timings. Every measurement lands at once in $OUT/results.jsonl; the log of
# each stage in $OUT/log.txt. At the end the run is summarised into
# $OUT/summary.json and its proofs written into $OUT/proven.json (a copy of
# keras_longattn/kernels/proven.json refreshed by this run: a path kind
# whose every planned case passed is proven for the GPU's vendor on its
# current sources, one with a failed case loses its proof). To keep them,
# copy $OUT/results.jsonl to $RUN_FILE (the run file the proofs cite,
# default docs/benchmarks/device_runs/device-check-DATE.jsonl) and
# $OUT/proven.json over keras_longattn/kernels/proven.json, and commit both.
# DEVICE_CHECK_COMMIT names the commit the sources came from (default: git
# HEAD where there is a checkout). Summarise again on any machine with
#   python -m keras_longattn.benchmarks.device_report $OUT/results.jsonl
# DEVICE_CHECK_DRY=1 runs the same stages at toy sizes on a CPU (no proof).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-device_check_out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import keras" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/device_check_site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/device_check_site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DEVICE_CHECK_OUT="$OUT" PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
# Two compile threads per process: the correctness shards run a dozen
# processes side by side on 16 cores (22 processes with 16 threads each
# stalled every case past a 180 s limit on an H200 machine).
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}


stage() {  # stage SECONDS BACKEND NAME [SHARD/SHARDS]
    local started=$SECONDS log="$OUT/log-$2-$3${4:+-${4%/*}}.txt"
    echo "=== $2 $3 ${4:-} (limit $1 s)" >> "$log"
    DEVICE_CHECK_STAGE_SECONDS=$1 KERAS_BACKEND=$2 \
        timeout -k 5 $(( $1 + 15 )) "$PYTHON" scripts/device_check.py "$3" ${4:-} \
        >> "$log" 2>&1
    echo "=== $2 $3 ${4:-} rc=$? in $(( SECONDS - started )) s" >> "$log"
}

# Correctness: compiling dominates, so the cases run in shards side by side
# (both backends at once; no GPU memory preallocated by JAX meanwhile).
SHARDS=${SHARDS:-6}
for (( i = 0; i < SHARDS; i++ )); do
    XLA_PYTHON_CLIENT_PREALLOCATE=false stage "${LIMIT_CORRECT:-270}" jax correct "$i/$SHARDS" &
    stage "${LIMIT_CORRECT:-270}" torch correct "$i/$SHARDS" &
done
wait
# Timings: one process at a time.
stage "${LIMIT_JAX_BENCH:-110}" jax bench
stage "${LIMIT_TORCH_BENCH:-120}" torch bench
cat "$OUT"/log-*.txt > "$OUT/log.txt"
rm -f "$OUT"/log-*.txt
grep "^===" "$OUT/log.txt" | grep rc=
# Summary and proofs of this run.
RUN_FILE=${RUN_FILE:-docs/benchmarks/device_runs/device-check-$(date -u +%Y-%m-%d).jsonl}
COMMIT=${DEVICE_CHECK_COMMIT:-$(git rev-parse HEAD 2>/dev/null || true)}
cp keras_longattn/kernels/proven.json "$OUT/proven.json"
KERAS_BACKEND=jax "$PYTHON" -m keras_longattn.benchmarks.device_report "$OUT/results.jsonl" \
    --write "$OUT/summary.json" --prove "$OUT/proven.json" --run-file "$RUN_FILE" \
    ${COMMIT:+--commit "$COMMIT"} 2>&1 | tee -a "$OUT/log.txt" | grep -E "^(proved|removed|PASS|FAIL)"
echo "proofs in $OUT/proven.json cite $RUN_FILE: copy $OUT/results.jsonl there to keep them"
