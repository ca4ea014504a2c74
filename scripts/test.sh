#!/usr/bin/env bash
# The whole test suite: once per Keras backend, each in its own pytest
# process, then the notebooks and the docs (scripts/extra_stages.sh). Two
# lanes share the two cores (see below; TEST_LANES=1: one after the other).
# Extra arguments go to pytest. Logs: build/test-logs/.
#   bash scripts/test.sh                 # everything
#   BACKENDS=jax bash scripts/test.sh -k local
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
t0=$(date +%s)
source scripts/bootstrap.sh || { echo "[test] set-up failed"; exit 1; }
# bootstrap.sh sets -e for itself; here a failing backend must not stop the
# others or the summary.
set +e
echo "[stage] setup: $(( $(date +%s) - t0 ))s"

# Compilation caches outside the clone: JAX's persistent cache (XLA
# programs, keyed by the program, the XLA flags and the jax version) and
# TorchInductor's. Two thirds of the JAX unit tests' time is XLA compiling
# small programs; a machine that ran the suite before reuses them, a new
# machine starts empty and fills the cache as it goes. Nothing else changes:
# the same tests run and compute the same values.
# KERAS_LONGATTN_COMPILE_CACHE=off: no cache; =DIR: another place.
# No size limit for JAX (its LRU bookkeeping lists the whole folder on
# every write: quadratic in the thousands of small programs); instead the
# folder is emptied when it has grown past 4 GiB.
cache_root="${KERAS_LONGATTN_COMPILE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/keras-longattn}"
if [ "$cache_root" != off ] && mkdir -p "$cache_root/jax" "$cache_root/torchinductor" "$cache_root/torch_extensions" 2>/dev/null; then
  if [ "$(du -sk "$cache_root" | cut -f1)" -gt $(( 4 * 1024 * 1024 )) ]; then
    echo "[test] compilation caches over 4 GiB: emptied"
    rm -rf "$cache_root/jax" "$cache_root/torchinductor" "$cache_root/torch_extensions"
    mkdir -p "$cache_root/jax" "$cache_root/torchinductor" "$cache_root/torch_extensions"
  fi
  export JAX_COMPILATION_CACHE_DIR="$cache_root/jax"
  export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
  export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
  export TORCHINDUCTOR_CACHE_DIR="$cache_root/torchinductor"
  # The C++ band kernel (kernels/torch/native.py), built once per machine.
  export TORCH_EXTENSIONS_DIR="$cache_root/torch_extensions"
  echo "[test] compilation caches in $cache_root ($(du -sh "$cache_root" 2>/dev/null | cut -f1) now)"
fi

LOGS="$ROOT/build/test-logs"
rm -rf "$LOGS" && mkdir -p "$LOGS"

# One backend's unit tests in one pytest process; its output goes to a log
# that is printed whole when the run ends (two lanes never interleave lines).
unit_tests() {
  local backend=$1 s rc xla_flags label="${UNIT_LABEL:-$1}"
  shift
  s=$(date +%s)
  xla_flags="${XLA_FLAGS:-}"
  if { [ "$backend" = jax ] || [ "$backend" = tensorflow ]; } && [ -z "${KEEP_XLA_OPTIMIZATION:-}" ]; then
    # The unit tests run small inputs once: on jax their time is mostly XLA
    # compiling each primitive (eager) or program (jit) for the CPU, and on
    # tensorflow XLA compiling the jit_compile=True steps (Keras' default
    # there). Less LLVM optimisation and XLA's older loop emitters instead
    # of its fusion emitters compile about a third faster and compute the
    # same values within the tests' tolerances; benchmarks and notebooks
    # keep the default (KEEP_XLA_OPTIMIZATION=1 keeps it here too).
    xla_flags="$xla_flags --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"
  fi
  # --junitxml: every test's time, summed by file and folder afterwards
  # (python scripts/test_times.py build/test-logs/*.xml).
  XLA_FLAGS="$xla_flags" KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider --durations=15 \
    --junitxml="$LOGS/unit-$label.xml" "$@" >"$LOGS/unit-$label.log" 2>&1
  rc=$?
  if [ $rc -eq 5 ]; then
    echo "[test] $label: no tests collected" >>"$LOGS/unit-$label.log"
    rc=0
  fi
  show "$LOGS/unit-$label.log" "unit tests, KERAS_BACKEND=$backend ($label)"
  record "unit tests ($label): rc=$rc, $(( $(date +%s) - s ))s" $rc
  return $rc
}

# Stages of scripts/extra_stages.sh (notebooks and docs), logged likewise.
extra() {
  local name=$1 s rc
  shift
  s=$(date +%s)
  STAGES="$*" bash scripts/extra_stages.sh >"$LOGS/extra-$name.log" 2>&1
  rc=$?
  show "$LOGS/extra-$name.log" "stages: $*"
  record "stages $* ($name): rc=$rc, $(( $(date +%s) - s ))s" $rc
  return $rc
}

show() {
  # flock: the two lanes print one whole log at a time.
  ( flock 9; echo "[stage] $2 ($(basename "$1"))"; cat "$1" ) 9>"$LOGS/.print.lock"
}

record() {
  echo "$1" >>"$LOGS/summary"
  [ "$2" -ne 0 ] && touch "$LOGS/failed"
  return 0
}

with_extra=1
[ -x scripts/extra_stages.sh ] && [ -z "${SKIP_EXTRA_STAGES:-}" ] || with_extra=0
backends=(${BACKENDS:-jax tensorflow torch})

# The browser stage's Chromium, when the machine lacks it, is installed by
# apt-get in the background while the tests run (network and disk, not the
# cores); the docs job waits for it.
# (A marker file, not `wait`: the docs job runs in a worker's subshell,
# of which the installation is not a child.)
if [ $with_extra -eq 1 ]; then
  ( STAGES=chromium bash scripts/extra_stages.sh >"$LOGS/extra-chromium.log" 2>&1
    touch "$LOGS/.chromium-done" ) &
fi
# docs: the build and browser stages, once Chromium is installed (or its
# installation failed: the browser stage then says why).
docs_job() {
  while [ ! -e "$LOGS/.chromium-done" ]; do sleep 2; done
  extra docs build browser
}

if [ "${TEST_LANES:-2}" -ge 2 ] && [ ${#backends[@]} -ge 2 ]; then
  # TEST_LANES workers (default 2, one per core) take jobs from one queue,
  # longest first, until it is empty, the docs build and the browser check
  # last of them. A job is one pytest process (a backend's unit tests, a part of
  # them, or one notebook under nbval) or one extra stage, never pytest-xdist,
  # so a worker never waits for the other at a barrier. No unit test
  # measures time. The paper notebooks, whose claims include same-run speed
  # ratios, may run beside another job: a notebook's ratios are between
  # layers of its own run, which share the machine alike.
  # The first backend's unit tests (JAX: mostly XLA compiling small
  # programs) take longest: with no pytest arguments the files of
  # LANE2_TESTS run in a job of their own (sharing the compilation cache),
  # and tests/parallel too (JAX split into 8 simulated devices, set before
  # JAX starts).
  first=${backends[0]}
  first_args=("$@")
  split=()
  if [ $# -eq 0 ]; then
    for path in ${LANE2_TESTS-tests/layers/test_properties.py tests/kernels/test_pallas_tpu.py tests/test_device_check.py tests/notebooks/test_planted_real_routing.py tests/notebooks/test_planted_real_longify.py tests/hub/test_longify.py}; do
      [ -e "$path" ] || continue
      first_args+=("--ignore=$path")
      split+=("$path")
    done
  fi
  parallel_tests=()
  if [ $# -eq 0 ] && [ "$first" = jax ] && [ -d tests/parallel ]; then
    first_args+=("--ignore=tests/parallel")
    parallel_tests=(tests/parallel)
  fi
  jobs=(first)
  for backend in "${backends[@]:1}"; do jobs+=("unit $backend"); done
  [ ${#split[@]} -gt 0 ] && jobs+=(split)
  [ ${#parallel_tests[@]} -gt 0 ] && jobs+=(parallel)
  if [ $with_extra -eq 1 ]; then
    # (the lra stage is not a job: tests/lra runs the command end to end)
    jobs+=(notebooks)
    # The notebooks' CI sizes take about 5, 5, 3, 3, 2... minutes: longest
    # first (the notebooks stage runs those of NOTEBOOKS instead).
    for slug in ${NBVAL_ORDER:-sparse_transformer routing_transformer adamra linformer longify longformer synthesizer sandwich_transformer entmax mpnet adaptive_span}; do
      [ -f "notebooks/$slug.ipynb" ] && [[ " ${NOTEBOOKS:-quickstart generation} " != *" $slug "* ]] && jobs+=("nbval $slug")
    done
    for path in notebooks/*.ipynb; do
      slug=$(basename "$path" .ipynb)
      [[ " ${jobs[*]} " == *" nbval $slug "* ]] && continue
      [[ " ${NOTEBOOKS:-quickstart generation} " == *" $slug "* ]] && continue
      jobs+=("nbval $slug")
    done
    # The docs job comes last in the queue: the notebooks job (whose
    # notebooks' pages show this run) is long done when a worker takes it.
    jobs+=(docs)
  fi
  # run_job JOB [PYTEST ARGS]: the arguments go to the other backends' unit tests.
  run_job() {
    case "$1" in
      first) unit_tests "$first" "${first_args[@]}" ;;
      "unit "*) unit_tests "${1#unit }" "${@:2}" ;;
      split) UNIT_LABEL="$first-lane2" unit_tests "$first" "${split[@]}" ;;
      parallel) KERAS_LONGATTN_HOST_DEVICES=8 UNIT_LABEL="$first-parallel" \
                  unit_tests "$first" "${parallel_tests[@]}" ;;
      notebooks) extra notebooks notebooks; local rc=$?; touch "$LOGS/.notebooks-done"; return $rc ;;
      docs) while [ ! -e "$LOGS/.notebooks-done" ]; do sleep 2; done; docs_job ;;
      lra) extra lra lra ;;
      "nbval "*) NBVAL_SLUGS="${1#nbval }" extra "nbval-${1#nbval }" nbval ;;
    esac
  }
  echo "[stage] ${#jobs[@]} jobs on ${TEST_LANES:-2} workers: ${jobs[*]}"
  echo 0 >"$LOGS/.next"
  worker() {
    local w=$1 index job s
    shift
    while :; do
      index=$( ( flock 8; i=$(cat "$LOGS/.next"); echo $(( i + 1 )) >"$LOGS/.next"; echo "$i" ) 8>"$LOGS/.queue.lock" )
      [ "$index" -lt ${#jobs[@]} ] || return 0
      job=${jobs[$index]}
      s=$(date +%s)
      run_job "$job" "$@"
      echo "worker $w: $job $(( $(date +%s) - s ))s" >>"$LOGS/schedule"
    done
  }
  pids=()
  for w in $(seq 1 "${TEST_LANES:-2}"); do
    worker "$w" "$@" &
    pids+=($!)
  done
  wait "${pids[@]}"
else
  for backend in "${backends[@]}"; do
    if [ $# -eq 0 ] && [ "$backend" = jax ] && [ -d tests/parallel ]; then
      unit_tests jax --ignore=tests/parallel
      KERAS_LONGATTN_HOST_DEVICES=8 UNIT_LABEL=jax-parallel unit_tests jax tests/parallel
    else
      unit_tests "$backend" "$@"
    fi
  done
  if [ $with_extra -eq 1 ]; then
    extra all notebooks nbval
    docs_job
  fi
fi

status=0
[ -f "$LOGS/failed" ] && status=1
echo "[stage] summary (logs in build/test-logs/)"
sed 's/^/  /' "$LOGS/summary"
[ -f "$LOGS/schedule" ] && sed 's/^/  /' "$LOGS/schedule"
echo "  total: $(( $(date +%s) - t0 ))s"
exit $status
