"""Unit tests of the Sparse Transformer notebook's claim checks.

The checks are the notebook's own (``keras_longattn.reproductions.sparse_transformer``).
The mechanism measurements run on tiny real layers (which keys a sparse
layer's heads really read on its training path); the training and cost
results that the other claims read are synthetic per-seed numbers shaped
like the notebook's outputs. These test the check functions only: the
planted bugs that count are the real broken layers trained through the
notebook's functions, ``sparse_transformer.PLANTED``, run by
``tests/notebooks/test_planted_real.py``.
"""

import functools

import numpy as np

import keras

from keras_longattn.layers import FullAttention, SparseAttention
from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import sparse_transformer as st


def _failed(claims):
    return {c.name for c in claims if c.failed}



# ------------------------------------------------------------------- sparse

SPARSE_MARGINS = dict(image_margin=0.1, repeat_margin=0.3, text_margin=0.05,
                      min_step_speedup=1.3, min_bench_speedup=2.0,
                      min_bench_memory_ratio=2.0, min_cost_flops_ratio=2.0,
                      min_cost_memory_ratio=2.0)


def _sparse_layer(pattern, **kwargs):
    keras.utils.set_random_seed(0)
    return SparseAttention(num_heads=2, key_dim=4, pattern=pattern, block_length=4,
                           summary_width=1 if pattern == "fixed" else None, **kwargs)


@functools.lru_cache(maxsize=None)
def _measured(pattern, causal=True):
    """Measured head masks of a tiny SparseAttention (n = 24, l = 4), once
    per pattern (the measurement is the slow part of these tests)."""
    masks = st.measured_head_masks(_sparse_layer(pattern), 24, 8, causal=causal)
    masks.flags.writeable = False
    return masks


def _coverage(pattern):
    return st.two_step_coverage(_measured(pattern))


def _coverage_without_head_b(pattern):
    masks = _measured(pattern).copy()
    masks[1:] = False  # head 1 is head B in "multihead": its output removed
    return st.two_step_coverage(masks)


def _sparse_results(coverage, repeat=None, image_steps=None, bench=None, cost=None,
                    image=None):
    repeat = repeat or {"dense": [0.05, 0.07], "strided": [0.06, 0.08],
                        "fixed": [0.5, 0.6], "local": [1.1, 1.12]}
    image_steps = image_steps or {"dense": [0.30, 0.32, 0.31], "strided": [0.1, 0.11, 0.1],
                                  "fixed": [0.1, 0.12, 0.11]}
    bench = bench or {"dense": {"median_ms": 100.0, "peak_mib": 200.0},
                      "strided": {"median_ms": 10.0, "peak_mib": 20.0},
                      "fixed": {"median_ms": 20.0, "peak_mib": 30.0}}
    cost = cost or {"dense": {"flops": 1e9, "temp_bytes": 7e7},
                    "strided": {"flops": 1.4e8, "temp_bytes": 5e6},
                    "fixed": {"flops": 1.5e8, "temp_bytes": 5e6}}
    image = image or {"dense": [1.0, 1.02], "strided": [0.95, 0.97], "fixed": [1.0, 1.03],
                      "local": [1.1, 1.12]}
    return {
        "coverage": coverage,
        "image_bits": image,
        "cost": cost,
        "repeat_bits": repeat,
        "image_step_seconds": image_steps,
        "bench": bench,
    }


def test_sparse_measured_patterns_match_the_pattern_objects():
    for pattern in ("strided", "fixed"):
        masks = _measured(pattern)
        a, b = _sparse_layer(pattern).head_patterns(24, 24, True)
        for measured, objects in ((masks[0], a), (masks[1], b)):
            expected = np.asarray(keras.ops.convert_to_numpy(objects.dense_mask(24, 24)), bool)
            # Off the diagonal (output i always depends on input i through
            # its query), the measured keys are the pattern's.
            off = ~np.eye(24, dtype=bool)
            assert np.array_equal(measured[off], expected[off]), pattern


def test_sparse_real_layers_pass():
    coverage = {p: _coverage(p) for p in ("strided", "fixed")}
    claims = st.sparse_claims(_sparse_results(coverage), SPARSE_MARGINS)
    assert not _failed(claims)
    cl.assert_claims(claims)


def test_sparse_planted_head_b_removed_fails():
    # Bug: no summary (fixed) or column (strided) head. Measured on the real
    # layer with that head's output removed; a model without it is local
    # attention on the repeated images.
    coverage = {p: _coverage_without_head_b(p) for p in ("strided", "fixed")}
    assert all(not complete for complete, _ in coverage.values())
    local_like = {"dense": [0.05, 0.07], "strided": [1.1, 1.13], "fixed": [1.11, 1.12],
                  "local": [1.1, 1.12]}
    claims = st.sparse_claims(_sparse_results(coverage, repeat=local_like), SPARSE_MARGINS)
    assert {"coverage_strided", "coverage_fixed", "repeat_strided_beats_local"} <= _failed(claims)


def test_sparse_planted_causal_leak_fails():
    # Bug: a pattern that reads later positions (the causal mask dropped).
    complete, causal_only = st.two_step_coverage(_measured("strided", causal=False))
    assert complete and not causal_only
    claims = st.sparse_claims(_sparse_results({"strided": (complete, causal_only)}),
                              SPARSE_MARGINS)
    assert "coverage_strided" in _failed(claims)


def test_sparse_planted_dense_swap_fails_on_cost():
    # Bug: the sparse layers swapped for dense attention. Measured patterns
    # are the whole causal triangle (coverage holds), so it is the cost
    # claims that must fail: the same compiled FLOPs and temporary memory.
    # The wall-clock claims (step time, scaling run) are reported only.
    masks = st.measured_head_masks(FullAttention(num_heads=2, key_dim=4), 24, 8)
    assert masks.all(axis=0)[np.tril_indices(24)].all()
    coverage = {"strided": st.two_step_coverage(masks), "fixed": st.two_step_coverage(masks)}
    same = [0.30, 0.31, 0.32]
    steps = {"dense": same, "strided": list(same), "fixed": list(same)}
    row = {"median_ms": 100.0, "peak_mib": 200.0}
    bench = {"dense": row, "strided": dict(row), "fixed": dict(row)}
    compiled = {"flops": 1e9, "temp_bytes": 7e7}
    cost = {"dense": compiled, "strided": dict(compiled), "fixed": dict(compiled)}
    claims = st.sparse_claims(
        _sparse_results(coverage, image_steps=steps, bench=bench, cost=cost), SPARSE_MARGINS)
    assert _failed(claims) == {"cost_strided", "cost_fixed"}
    by_name = {c.name: c for c in claims}
    for name in ("image_step_strided", "image_step_fixed", "bench_strided", "bench_fixed"):
        assert not by_name[name].asserted
        assert by_name[name].verdict == cl.NOT_REPRODUCED


def test_sparse_cost_not_measured_is_reported():
    # On a backend other than JAX there is no compiled cost: the claims are
    # reported as not measured, not asserted.
    coverage = {p: _coverage(p) for p in ("strided", "fixed")}
    results = _sparse_results(coverage)
    results["cost"] = None
    results["bench"] = None
    by_name = {c.name: c for c in st.sparse_claims(results, SPARSE_MARGINS)}
    for name in ("cost_strided", "cost_fixed", "bench_strided", "bench_fixed"):
        assert not by_name[name].asserted
        assert by_name[name].verdict == cl.NOT_TESTABLE


def test_sparse_image_parity_not_testable_when_the_local_control_passes():
    # Dense no better than the local control: the parity check passes for
    # the control too, so it cannot tell strided from it.
    coverage = {p: _coverage(p) for p in ("strided", "fixed")}
    image = {"dense": [1.0, 1.02], "strided": [0.95, 0.97], "fixed": [1.0, 1.03],
             "local": [0.98, 1.0]}
    by_name = {c.name: c for c in st.sparse_claims(_sparse_results(coverage, image=image),
                                                   SPARSE_MARGINS)}
    parity = by_name["image_strided_vs_dense"]
    assert not parity.asserted
    assert parity.verdict == cl.NOT_TESTABLE
    assert "local" in parity.detail


def test_sparse_image_parity_verdict_when_dense_beats_the_local_control():
    coverage = {p: _coverage(p) for p in ("strided", "fixed")}
    results = _sparse_results(coverage, image={
        "dense": [0.70, 0.72], "strided": [0.74, 0.76], "fixed": [0.9, 0.92],
        "local": [0.9, 0.91]})
    parity = {c.name: c for c in st.sparse_claims(results, SPARSE_MARGINS)}[
        "image_strided_vs_dense"]
    assert parity.verdict == cl.REPRODUCED and not parity.asserted
    results["image_bits"]["strided"] = [0.9, 0.91]  # strided like the control
    parity = {c.name: c for c in st.sparse_claims(results, SPARSE_MARGINS)}[
        "image_strided_vs_dense"]
    assert parity.verdict == cl.NOT_REPRODUCED


def test_sparse_plateau_claims_are_reported():
    coverage = {p: _coverage(p) for p in ("strided", "fixed")}
    results = _sparse_results(coverage)
    results["plateau"] = {"steps": 1200, "best_learning_rate": 0.005, "arms": {
        "dense": {"first": [0.60, 0.62]}, "strided": {"first": [0.61, 0.63]},
        "local": {"first": [0.80, 0.82]}}}
    by_name = {c.name: c for c in st.sparse_claims(results, SPARSE_MARGINS)}
    assert by_name["plateau_dense_beats_local"].verdict == cl.REPRODUCED
    assert by_name["plateau_strided_vs_dense"].verdict == cl.REPRODUCED
    assert not by_name["plateau_dense_beats_local"].asserted
    assert not by_name["plateau_strided_vs_dense"].asserted
    results["plateau"]["arms"]["local"] = {"first": [0.62, 0.63]}
    by_name = {c.name: c for c in st.sparse_claims(results, SPARSE_MARGINS)}
    assert by_name["plateau_strided_vs_dense"].verdict == cl.NOT_TESTABLE
