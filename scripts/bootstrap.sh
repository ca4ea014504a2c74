#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and installs the
# package with every extra. Sourced by scripts/test.sh and scripts/main.sh.
# Needs nothing but Python >= 3.10 on the machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KERAS_LONGATTN_VENV:-$ROOT/.venv}"
PYTHON_BIN="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PYTHON_BIN" -m venv "$VENV"
fi
# Reinstall only when the dependency declarations change.
STAMP="$VENV/.keras-longattn-installed"
HASH="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" "$ROOT/requirements-hub.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$HASH" ]; then
  echo "[setup] installing keras-longattn[jax,tensorflow,torch,notebooks,docs,export,dev] (constraints.txt pins torch)"
  start=$(date +%s)
  # --no-compile: no byte-compiling of every installed module (torch,
  # tensorflow and jax hold tens of thousands; about half the install time
  # on a 2-core machine); Python compiles and caches the modules a process
  # imports, the first time it imports them.
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile \
    -c "$ROOT/constraints.txt" -e "$ROOT[jax,tensorflow,torch,notebooks,docs,export,dev]" \
    2> >(grep -v "^WARNING: Location" >&2)
  # keras-hub (the decode benchmark's peer) without its dependencies:
  # tensorflow-text would pull the full tensorflow (see requirements-hub.txt).
  echo "[setup] installing keras-hub --no-deps (requirements-hub.txt)"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps \
    -r "$ROOT/requirements-hub.txt" 2> >(grep -v "^WARNING: Location" >&2)
  echo "$HASH" > "$STAMP"
  echo "[setup] installed in $(( $(date +%s) - start ))s"
fi
export PATH="$VENV/bin:$PATH"
# The install does not byte-compile (above): Python compiles a module the
# first time a process imports it and keeps the .pyc, unless
# PYTHONDONTWRITEBYTECODE is set, which would make every process (each
# test's subprocess, each notebook kernel) compile torch, tensorflow and
# jax from source again. The .pyc files go into one folder of the virtual
# environment (PYTHONPYCACHEPREFIX), none into the checkout.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-$VENV/pycache}"
export PYTHONHASHSEED=0
# Quieter logs from the backends.
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
