"""The device check's summary: ratios within one run, criteria from the
numbers, correctness verdicts (failed, unchecked, passed), and the proven
table's entries backed by the committed results."""

import json

import pytest

from keras_longattn.benchmarks import device_report as dr

# The outcome does not depend on the Keras backend: one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free


def _run(local_ms=10.0, cudnn_ms=8.0, full_ms=300.0, flex_ms=5.0, direct_ms=4.8, peak=800.0,
         case_status="pass", million=True):
    n = dr.CRITERIA_LENGTH
    pairs = n * 512
    tflops = lambda ms: 3.5 * 4 * pairs * 128 * 16 / (ms / 1e3) / 1e12  # noqa: E731
    rows = [
        {"kind": "device", "backend": "jax", "name": "Test GPU"},
        {"kind": "peak", "backend": "jax", "status": "ok", "tflops": peak / 2},
        {"kind": "peak", "backend": "torch", "status": "ok", "tflops": peak},
        {"kind": "bench", "backend": "jax", "status": "ok", "method": "full_cudnn", "n": n,
         "ms": full_ms},
        {"kind": "bench", "backend": "jax", "status": "ok", "method": "local_cudnn_window",
         "n": n, "ms": cudnn_ms, "useful_tflops": tflops(cudnn_ms)},
        {"kind": "bench", "backend": "jax", "status": "ok", "method": "local_pallas", "n": n,
         "ms": local_ms, "useful_tflops": tflops(local_ms)},
        {"kind": "bench", "backend": "torch", "status": "ok", "method": "full_sdpa", "n": n,
         "ms": full_ms},
        {"kind": "bench", "backend": "torch", "status": "ok", "method": "local_flex_direct",
         "n": n, "ms": direct_ms, "useful_tflops": tflops(direct_ms)},
        {"kind": "bench", "backend": "torch", "status": "ok", "method": "local_flex", "n": n,
         "ms": flex_ms, "useful_tflops": tflops(flex_ms)},
        {"kind": "correct", "backend": "jax", "case": "local-causal", "status": case_status},
    ]
    if million:
        rows.append({"kind": "bench", "backend": "jax", "status": "ok",
                     "method": "local_pallas", "n": dr.MILLION, "ms": 90.0})
    return rows


def _criteria(summary):
    return {c["criterion"]: c for c in summary["criteria"]}


def test_criteria_follow_the_numbers():
    good = _criteria(dr.summarize(_run(local_ms=8.0, cudnn_ms=7.0, flex_ms=5.0,
                                       direct_ms=4.8, peak=300.0)))
    assert all(c["passed"] for c in good.values()), good
    bad = _criteria(dr.summarize(_run(local_ms=20.0, flex_ms=8.0, case_status="fail",
                                      million=False)))
    assert bad["Pallas Local >= 0.8x the useful throughput of cuDNN's sliding window"][
        "passed"] is False
    assert bad["Flex Local at most 1.1x the time of FlexAttention used directly"][
        "passed"] is False
    assert bad["local_pallas at least 20x faster than full attention"]["passed"] is False
    assert bad[dr.ALL_PATHS]["passed"] is False
    assert bad["1,048,576 tokens of Local forward+backward on one GPU"]["passed"] is None


def test_fraction_of_peak_uses_the_runs_fastest_product():
    summary = dr.summarize(_run(peak=800.0))
    assert summary["run_peak_tflops"] == 800.0
    row = next(t for t in summary["timings"] if t["method"] == "local_pallas"
               and t["n"] == dr.CRITERIA_LENGTH)
    assert abs(row["fraction_of_peak"] - row["useful_tflops"] / 800.0) < 1e-12


def test_runs_never_mix_in_a_ratio():
    """A criterion's numbers come from one run; a later run that did not
    measure it leaves the earlier run's verdict, labelled with its run."""
    first = _run(flex_ms=8.0, direct_ms=4.0)
    second = [r for r in _run(flex_ms=4.0, direct_ms=4.0)
              if r.get("method") not in ("local_flex",)]
    merged = _criteria(dr.summarize_runs([(first, "a" * 40), (second, "b" * 40)]))
    flex = merged["Flex Local at most 1.1x the time of FlexAttention used directly"]
    assert flex["run"] == 1 and flex["commit"] == "a" * 40 and flex["ratio"] == 2.0


def test_unchecked_cases_are_not_passes():
    rows = _run()
    rows.append({"kind": "correct", "backend": "torch", "case": "x", "status": "skipped"})
    verdict = _criteria(dr.summarize(rows))[dr.ALL_PATHS]
    assert verdict["passed"] is None and verdict["unchecked"] == ["torch:x"]


def test_proven_entries_are_backed_by_the_committed_check():
    """Each proof of the proven table cites committed runs of the device
    check on its devices in which every case of its path passed (see also
    tests/kernels/test_trust_48.py)."""
    from pathlib import Path

    from keras_longattn.kernels import proven

    root = Path(__file__).resolve().parents[2]
    assert proven.PROVEN, "the table is loaded from proven.json"
    for (backend, vendor), kinds in proven.PROVEN.items():
        for kind, entry in kinds.items():
            rows = [r for name in entry["runs"] for r in dr.load(root / name)]
            names = {r["name"] for r in rows if r.get("kind") == "device"
                     and r["backend"] == backend}
            assert names and names <= set(entry["devices"]), (backend, kind, names)
            cases = {c["case"]: c["status"] for c in dr.correctness_table(rows)
                     if c["backend"] == backend and c["path"] == kind}
            assert sorted(cases) == sorted(entry["cases"]), (backend, kind)
            assert set(cases.values()) == {"pass"}, (backend, kind)