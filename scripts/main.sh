#!/usr/bin/env bash
# The main job: the quick (CI-size) paper reproductions, executed with
# papermill into build/notebooks/ with a report of their claims, then the
# benchmark of the attention layers (speed and memory against FullAttention,
# on every backend). Arguments replace the benchmark's defaults, e.g.
# `bash scripts/main.sh --layers full,local --lengths 16384 --backends torch`;
# SKIP_REPRODUCTIONS=1 runs the benchmark only.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/bootstrap.sh
if [ $# -eq 0 ]; then
  set -- --layers full,local --lengths 1024,4096 --backends jax,tensorflow,torch \
         --modes fwdbwd --repeats 3 --window 256
fi
if [ -z "${SKIP_REPRODUCTIONS:-}" ]; then
  keras-longattn reproduce --all --output-dir build/notebooks
fi
exec keras-longattn bench "$@"
