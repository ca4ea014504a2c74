#!/usr/bin/env bash
# The main job: the benchmark of the attention layers (speed and memory
# against FullAttention, on every backend). Arguments replace the defaults,
# e.g. `bash scripts/main.sh --layers full,local --lengths 16384 --backends torch`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/bootstrap.sh
if [ $# -eq 0 ]; then
  set -- --layers full,local --lengths 1024,4096 --backends jax,tensorflow,torch \
         --modes fwdbwd --repeats 3 --window 256
fi
exec keras-longattn bench "$@"
