#!/usr/bin/env bash
# The notebooks and the documentation site, after the unit tests.
# Called by scripts/test.sh with the virtual environment on PATH; can be run
# alone the same way:
#   source scripts/bootstrap.sh && bash scripts/extra_stages.sh
#   STAGES="build browser" bash scripts/extra_stages.sh   # some stages only
#
# Stages (each prints "[stage] <name>: <seconds>s"; the first failure stops
# the script with its exit status):
#   notebooks  execute with papermill, at CI size, into build/notebooks/
#              (keras-longattn reproduce): the notebooks in NOTEBOOKS
#              (default: quickstart and generation, the notebooks without a
#              committed full-size run, so that their docs pages show this
#              run); every paper notebook is executed by the nbval stage
#   lra        the LRA-style command end to end, every task for one layer,
#              at its tiny size (it asserts nothing: the command runs and
#              writes its reports; keras-longattn lra; build/lra/)
#   nbval      execute every notebook of notebooks/ (committed without
#              outputs) but those of NOTEBOOKS, which the notebooks stage
#              executes (NOTEBOOKS=none: all of them), at its CI-size
#              defaults, with nbval (--nbval-lax:
#              every cell must run, so a failed claim assert fails it); the
#              paper notebooks write their CI-size results to
#              build/notebooks/<slug>.json. One execution per notebook: the
#              paper notebooks are not run by papermill as well unless
#              NOTEBOOKS=all. NBVAL_SHARD=i/n: the i-th of n shares;
#              NBVAL_SLUGS="a b": those notebooks only
#   build      first prints the committed results of docs/results/ whose
#              sources changed since they ran (keras-longattn reproduce
#              --stale; never fails the stage), then mkdocs build --strict
#              into site/; its hook docs/hooks/generate.py makes the pattern
#              figures, the benchmark page and the notebook pages (from
#              build/notebooks/ when the notebooks stage ran; a stale
#              committed run gets a note) into build/docs-generated/
#              (docs/gen_figures.py)
#   browser    serve site/ on 127.0.0.1 and look at pages in headless
#              Chromium (tests/docs/test_site_browser.py); installs Debian's
#              chromium package with apt-get when it is missing
#   chromium   that installation alone (not in the default STAGES;
#              scripts/test.sh runs it in the background at the start)
# Environment: NOTEBOOK_BACKEND (default: each notebook's own, jax),
# NOTEBOOKS (notebooks stage: slugs or "all"; default: "quickstart generation"),
# STAGES (default: all, in order).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONHASHSEED=0
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
export PYDEVD_DISABLE_FILE_VALIDATION=1
export NO_MKDOCS_2_WARNING=1
export MPLBACKEND=Agg
STAGES="${STAGES:-notebooks lra nbval build browser}"
NOTEBOOK_DIR=build/notebooks
NBVAL_DIR=build/nbval

python -c "import keras_longattn, papermill, nbval, mkdocs" 2>/dev/null || {
  echo "[extra] the virtual environment lacks the notebooks/docs/dev extras (source scripts/bootstrap.sh)"
  exit 1
}

stage_notebooks() {
  local backend_args=()
  [ -n "${NOTEBOOK_BACKEND:-}" ] && backend_args=(--backend "$NOTEBOOK_BACKEND")
  local selection=(${NOTEBOOKS:-quickstart generation})
  [ "${selection[*]}" = "none" ] && { echo "[notebooks] NOTEBOOKS=none: nothing to run"; return 0; }
  [ "${selection[*]}" = "all" ] && selection=(--all)
  python -m keras_longattn.reproduce "${selection[@]}" --output-dir "$NOTEBOOK_DIR" "${backend_args[@]}"
}

stage_lra() {
  python -m keras_longattn.cli lra --size tiny --layers full --seeds 1 --output build/lra --plain
}

stage_nbval() {
  # Copies of the committed notebooks, run from build/nbval so that what a
  # notebook writes next to itself stays out of notebooks/.
  # The notebooks that the notebooks stage executed with papermill (which
  # fails on a cell's error as nbval does) are not run a second time.
  # NBVAL_SHARD=i/n: only the i-th of n shares of those notebooks (the
  # i-th, (i+n)-th, ... in NBVAL_ORDER, then alphabetical), in
  # build/nbval-i, so that n processes can run at once.
  local dir="$NBVAL_DIR" shard="${NBVAL_SHARD:-1/1}"
  local index=${shard%/*} count=${shard#*/}
  [ "$count" -gt 1 ] && dir="$NBVAL_DIR-$index"
  # NBVAL_SLUGS="a b": exactly those notebooks, in build/nbval-<first slug>
  # (scripts/test.sh gives each notebook its own job).
  local only=" ${NBVAL_SLUGS:-} "
  if [ -n "${NBVAL_SLUGS:-}" ]; then
    dir="$NBVAL_DIR-${NBVAL_SLUGS%% *}" index=1 count=1
  fi
  rm -rf "$dir" && mkdir -p "$dir"
  local ran=" ${NOTEBOOKS:-quickstart generation} " path slug position=0 selected=() seen=" "
  for slug in ${NBVAL_ORDER:-} $(cd notebooks && ls *.ipynb | sed 's/\.ipynb$//'); do
    [[ "$seen" == *" $slug "* ]] && continue
    seen="$seen$slug "
    path="notebooks/$slug.ipynb"
    [ -f "$path" ] || continue
    [ -n "${NBVAL_SLUGS:-}" ] && [[ "$only" != *" $slug "* ]] && continue
    if [ "$ran" = " all " ] || [[ "$ran" == *" $slug "* ]]; then
      echo "[nbval] $slug: executed by the notebooks stage"
      continue
    fi
    position=$(( position + 1 ))
    [ $(( (position - 1) % count + 1 )) -eq "$index" ] || continue
    cp "$path" "$dir"/
    selected+=("$slug")
  done
  [ ${#selected[@]} -gt 0 ] || { echo "[nbval] nothing left to run"; return 0; }
  echo "[nbval] share $shard: ${selected[*]}"
  python -m pytest -p no:cacheprovider -q --nbval-lax --nbval-current-env "$dir"/*.ipynb
}

stage_docs() {
  # Kept for STAGES lists that name it: the build stage's mkdocs hook
  # generates the docs' figures and pages now.
  echo "[docs] nothing to do: mkdocs build generates the figures (docs/hooks/generate.py)"
}

stage_build() {
  # Informational: a stale committed result does not fail the stage.
  local stale rc
  stale=$(python -m keras_longattn.reproduce --stale 2>&1)
  rc=$?
  if [ $rc -ne 0 ]; then
    echo "[build] keras-longattn reproduce --stale failed (exit status $rc; not failing the stage):"
    printf '%s\n' "$stale" | tail -20 | sed 's/^/[build]   /'
  elif [ -n "$stale" ]; then
    echo "[build] committed results whose sources changed since they ran"
    echo "[build] (re-run them with: keras-longattn reproduce --stale --run):"
    printf '%s\n' "$stale" | sed 's/^/[build]   /'
  else
    echo "[build] every committed result of docs/results is up to date with its sources"
  fi
  mkdocs build --strict --clean
}

ensure_chromium() {
  if [ -n "${KERAS_LONGATTN_CHROMIUM:-}" ] || command -v chromium >/dev/null 2>&1; then
    return 0
  fi
  echo "[browser] chromium not found: installing Debian's chromium package"
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "[browser] FAILED: no apt-get here to install chromium; install it or set KERAS_LONGATTN_CHROMIUM"
    return 1
  fi
  local sudo=()
  [ "$(id -u)" -ne 0 ] && sudo=(sudo -n)
  if ! "${sudo[@]}" apt-get update -qq >/tmp/keras-longattn-apt.log 2>&1 \
     || ! DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends chromium \
          >>/tmp/keras-longattn-apt.log 2>&1; then
    tail -20 /tmp/keras-longattn-apt.log
    echo "[browser] FAILED: apt-get could not install chromium (log: /tmp/keras-longattn-apt.log)"
    return 1
  fi
  command -v chromium >/dev/null 2>&1 || { echo "[browser] FAILED: chromium still missing after apt-get"; return 1; }
}

stage_chromium() {
  # Only the browser stage's set-up: scripts/test.sh runs it in the
  # background while the tests run (apt-get waits on the network and the
  # disk, not on the cores).
  ensure_chromium
}

stage_browser() {
  ensure_chromium || return 1
  [ -f site/index.html ] || { echo "[browser] no site/index.html (run the build stage first)"; return 1; }
  local port
  port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python -m http.server "$port" --bind 127.0.0.1 --directory site >build/site-server.log 2>&1 &
  local server=$!
  # Wait until it answers (at most ~10 s).
  local ready=0
  for _ in $(seq 1 50); do
    if python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/', timeout=1)" 2>/dev/null; then
      ready=1; break
    fi
    sleep 0.2
  done
  local rc=1
  if [ $ready -eq 1 ]; then
    KERAS_LONGATTN_SITE_URL="http://127.0.0.1:$port" \
      python -m pytest -p no:cacheprovider -q tests/docs/test_site_browser.py
    rc=$?
  else
    echo "[browser] the site server did not start on 127.0.0.1:$port"; cat build/site-server.log
  fi
  kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
  return $rc
}

mkdir -p build
for name in $STAGES; do
  if ! declare -F "stage_$name" >/dev/null; then
    echo "[extra] unknown stage '$name' (stages: notebooks lra nbval build browser chromium)"
    exit 2
  fi
  start=$(date +%s)
  echo "[stage] $name ..."
  "stage_$name"
  rc=$?
  echo "[stage] $name: $(( $(date +%s) - start ))s"
  if [ $rc -ne 0 ]; then
    echo "[stage] $name FAILED (exit status $rc)"
    exit $rc
  fi
done
