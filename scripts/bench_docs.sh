#!/usr/bin/env bash
# Re-makes the committed benchmark files of the docs from fresh runs of
# `keras-longattn bench` on this machine, each file's runs merged with their
# provenance (scripts/merge_bench.py) so that `keras-longattn reproduce
# --stale` can tell when they no longer describe the sources:
#   docs/benchmarks/results.json          the benchmark page (~20 min on 2 cores)
#   docs/benchmarks/memory_per_token.json the memory-per-token curve (~6 min)
# Usage (in the project's virtual environment; one heavy process at a time):
#   bash scripts/bench_docs.sh [results] [memory]      # default: both
# The peer rows need the peer packages (keras_longattn/benchmarks/peers.py
# gives the pip line); without them those rows are reported as skipped.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT=build/bench-docs
which=("$@")
[ ${#which[@]} -gt 0 ] || which=(results memory)

bench() {  # bench NAME ARGS...: one run into $OUT/NAME
  local name=$1
  shift
  rm -rf "$OUT/$name"
  echo "[bench-docs] $name: keras-longattn bench $*"
  python -m keras_longattn.cli bench "$@" --modes fwdbwd --plain --output-dir "$OUT/$name"
}

results() {
  bench torch4k-attention --layers full,routing --lengths 4096 --backends torch \
    --no-causal --scope attention --repeats 10
  bench torch4k-layer --layers full,routing --lengths 4096 --backends torch \
    --no-causal --scope layer --repeats 10
  bench xla8k --layers full,local,sparse-strided,sparse-fixed,routing --lengths 8192 \
    --backends jax,tensorflow --repeats 3
  bench xla64k --layers local,sparse-strided,sparse-fixed,routing --lengths 65536 \
    --backends jax,tensorflow --no-baseline --repeats 1
  bench torch16k --layers full,local,sparse-strided,sparse-fixed,routing --lengths 16384 \
    --backends torch --repeats 3 --memory-limit-gb 12 --efficiency
  bench torch64k --layers local,sparse-strided,sparse-fixed,routing --lengths 65536 \
    --backends torch --no-baseline --repeats 3 --memory-limit-gb 12 --efficiency
  bench torch16k-attention --layers full,local,sparse-strided,sparse-fixed,routing \
    --peers local-attention,routing-transformer --lengths 16384 --backends torch \
    --scope attention --repeats 5 --warmup 3 --memory-limit-gb 12 --efficiency
  bench torch16k-attention-bidirectional --layers full,routing --peers routing-transformer \
    --lengths 16384 --backends torch --no-causal --scope attention --repeats 5 --warmup 3 \
    --memory-limit-gb 12 --efficiency
  bench torch8k-attention --layers full,local,sparse-strided,sparse-fixed --lengths 8192 \
    --backends torch --scope attention --repeats 9 --warmup 3 --memory-limit-gb 12 --efficiency
  python scripts/merge_bench.py docs/benchmarks/results.json \
    $OUT/{torch4k-attention,torch4k-layer,xla8k,xla64k,torch16k,torch64k,torch16k-attention,torch16k-attention-bidirectional,torch8k-attention}/latest.json \
    --command "bash scripts/bench_docs.sh results"
}

memory() {
  local fused='{"class_name": "LocalAttention", "config": {"name": "local_blocked_fused", "window": "${window}", "implementation": "blocked_fused"}}'
  bench memory --layers local --layers "$fused" --lengths 16384,65536,262144 --backends torch \
    --scope attention --repeats 1 --memory-limit-gb 12 --no-baseline --efficiency
  bench memory-1m --layers local --lengths 1048576 --backends torch --scope attention \
    --repeats 1 --memory-limit-gb 22 --timeout 850 --no-baseline --efficiency
  python scripts/merge_bench.py docs/benchmarks/memory_per_token.json \
    $OUT/memory/latest.json $OUT/memory-1m/latest.json \
    --command "bash scripts/bench_docs.sh memory" \
    --note "LocalAttention, window 256, causal, torch on the CPU, forward and backward of the attention alone: 'local' is what implementation='auto' runs (the path column names it), 'local_blocked_fused' the portable fused path named."
}

for name in "${which[@]}"; do
  case "$name" in
    results|memory) "$name" ;;
    *) echo "[bench-docs] unknown file '$name' (results, memory)"; exit 2 ;;
  esac
done
