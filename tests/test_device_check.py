"""The device check script runs on a CPU at toy sizes (``DEVICE_CHECK_DRY``)
and its summary reads what it wrote: the script stays runnable between the
sessions that have a GPU to run it on. JAX only (the Pallas path, interpreted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import pytest

from keras_longattn.benchmarks import device_report

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(keras.backend.backend() != "jax",
                                reason="the dry run checks the JAX stages")


def _stage(tmp_path, *args, **env):
    environment = dict(os.environ, DEVICE_CHECK_DRY="1", DEVICE_CHECK_OUT=str(tmp_path),
                       KERAS_BACKEND="jax", PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "device_check.py"), *args],
                          env=environment, capture_output=True, text=True, timeout=600)


def test_dry_run_of_the_stages_and_their_summary(tmp_path):
    done = _stage(tmp_path, "correct", "0/1", DEVICE_CHECK_CASES="local-causal")
    assert done.returncode == 0, done.stderr[-2000:]
    done = _stage(tmp_path, "bench", DEVICE_CHECK_SWEEP="default", DEVICE_CHECK_SIZES="256",
                  DEVICE_CHECK_MILLION="512")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = device_report.load(tmp_path / "results.jsonl")
    kinds = {r["kind"] for r in rows}
    assert {"device", "correct", "peak", "sweep", "bench", "provenance"} <= kinds
    summary = device_report.summarize(rows, commit="0" * 40)
    (case,) = summary["correctness"]
    assert case["case"] == "local-causal" and case["status"] == "pass"
    assert case["float32"]["ran"] == "pallas"
    timed = {(t["method"], t["n"]) for t in summary["timings"]}
    assert ("local_pallas", 256) in timed and ("local_pallas", 512) in timed
    assert summary["provenance"]["source_files"]
    json.dumps(summary)  # the summary is plain JSON
    # The stage records its whole plan and the hashes of each path's own
    # sources; a dry run on a CPU (filtered, no accelerator) proves nothing.
    # Proofs of a complete accelerator run: tests/kernels/test_trust_48.py.
    from keras_longattn.kernels import proven

    plan = device_report.planned_cases(rows)
    assert "local-causal" in plan[("jax", "pallas")] and len(plan[("jax", "pallas")]) == 11
    assert "local-causal-cudnn" in plan[("jax", "cudnn")]
    (sources,) = [r for r in rows if r["kind"] == "path_sources" and r["path"] == "pallas"]
    assert sources["files"] == proven.source_hashes("pallas")
    assert device_report.proof_entries(rows, "0" * 40, "dry run") == ([], [])
