#!/usr/bin/env bash
# The whole test suite: once per Keras backend, each in its own pytest
# process, sequentially. Extra arguments go to pytest.
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
cache_root="${KERAS_LONGATTN_COMPILE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/keras-longattn}"
if [ "$cache_root" != off ] && mkdir -p "$cache_root/jax" "$cache_root/torchinductor" 2>/dev/null; then
  export JAX_COMPILATION_CACHE_DIR="$cache_root/jax"
  export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
  export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
  export JAX_COMPILATION_CACHE_MAX_SIZE=$(( 2 * 1024 * 1024 * 1024 ))
  export TORCHINDUCTOR_CACHE_DIR="$cache_root/torchinductor"
  echo "[test] compilation caches in $cache_root ($(du -sh "$cache_root" 2>/dev/null | cut -f1) now)"
fi

status=0
summary=()
for backend in ${BACKENDS:-jax tensorflow torch}; do
  s=$(date +%s)
  echo "[stage] unit tests, KERAS_BACKEND=$backend"
  xla_flags="${XLA_FLAGS:-}"
  if [ "$backend" = jax ] && [ -z "${KEEP_XLA_OPTIMIZATION:-}" ]; then
    # The unit tests run small inputs once: on jax their time is mostly XLA
    # compiling each primitive (eager) or program (jit) for the CPU. Less
    # LLVM optimisation compiles ~30% faster and computes the same values;
    # benchmarks and notebooks keep the default (KEEP_XLA_OPTIMIZATION=1
    # keeps it here too).
    xla_flags="$xla_flags --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  fi
  XLA_FLAGS="$xla_flags" KERAS_BACKEND=$backend python -m pytest -q -p no:cacheprovider "$@"
  rc=$?
  if [ $rc -eq 5 ]; then
    echo "[test] $backend: no tests collected"
    rc=0
  fi
  [ $rc -ne 0 ] && status=1
  summary+=("unit tests ($backend): rc=$rc, $(( $(date +%s) - s ))s")
done

if [ -x scripts/extra_stages.sh ] && [ -z "${SKIP_EXTRA_STAGES:-}" ]; then
  s=$(date +%s)
  bash scripts/extra_stages.sh
  rc=$?
  [ $rc -ne 0 ] && status=1
  summary+=("notebooks and docs: rc=$rc, $(( $(date +%s) - s ))s")
fi

echo "[stage] summary"
for line in "${summary[@]}"; do echo "  $line"; done
echo "  total: $(( $(date +%s) - t0 ))s"
exit $status
