"""Unit tests of the Longformer notebook's claim checks
(``keras_longattn.reproductions.longformer.longformer_claims``).

The pattern, the global projections and the class token's reach are
measured on tiny real layers and models (the real ``LongformerAttention``
and the planted ``LocalOnlyLongformer`` and ``SharedProjectionLongformer``);
the training and cost numbers are synthetic values shaped like the
notebook's outputs. These check the check functions; the planted variants
that count (real broken layers trained through the notebook's functions)
are ``PLANTED`` in the module, run by ``tests/notebooks/test_planted_real.py``.
"""

import functools

import keras
import numpy as np
import pytest

from keras_longattn.layers import FullAttention, LongformerAttention
from keras_longattn.models import build_sequence_classifier
from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import longformer as lf
from keras_longattn.reproductions import sparse_transformer as st

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

MARGINS = dict(accuracy_margin=20.0, min_full_accuracy=80.0, max_blind_excess=10.0,
               bpb_margin=0.02, max_linear_growth=4.5, min_full_growth=10.0,
               min_memory_ratio=3.0, min_flops_ratio=3.0, min_bench_speedup=1.5,
               min_bench_memory_ratio=2.0)
COMPILED = {
    "full": {256: {"status": "ok", "temp_mib": 2.0, "gflops": 0.03},
             1024: {"status": "ok", "temp_mib": 32.0, "gflops": 0.46}},
    "longformer": {256: {"status": "ok", "temp_mib": 0.9, "gflops": 0.014},
                   1024: {"status": "ok", "temp_mib": 3.5, "gflops": 0.055}},
}
N, W, DILATIONS = 20, 4, (1, 2)
TASK_N, TASK_W, TASK_LAYERS, MIN_POSITION = 24, 4, 2, 8


def _failed(claims):
    return {c.name for c in claims if c.failed}


@functools.lru_cache(maxsize=None)
def _pattern(cls_name, global_tokens=1):
    """Measured and expected head masks of a tiny layer (2 heads,
    dilations 1 and 2, the first position global)."""
    cls = {"real": LongformerAttention, "local_only": lf.LocalOnlyLongformer,
           "full": FullAttention}[cls_name]
    keras.utils.set_random_seed(0)
    kwargs = {} if cls_name == "full" else dict(window=W, dilation=list(DILATIONS),
                                                 global_tokens=global_tokens)
    layer = cls(num_heads=2, key_dim=4, **kwargs)
    measured = st.measured_head_masks(layer, N, 8, causal=False)
    expected = lf.expected_head_masks(N, W, DILATIONS, global_positions=(0,))
    measured.flags.writeable = False
    return measured, expected


@functools.lru_cache(maxsize=None)
def _reads(arm):
    """Which tokens the class token of a fresh tiny classifier reads."""
    keras.utils.set_random_seed(0)
    attention = {
        "global": LongformerAttention(num_heads=2, key_dim=4, window=TASK_W, global_tokens=1),
        "local": LongformerAttention(num_heads=2, key_dim=4, window=TASK_W),
        "local_only": lf.LocalOnlyLongformer(num_heads=2, key_dim=4, window=TASK_W,
                                             global_tokens=1),
        "leaky": LongformerAttention(num_heads=2, key_dim=4, window=4 * TASK_W),
    }[arm]
    model = build_sequence_classifier(vocab_size=12, sequence_length=TASK_N, num_classes=2,
                                      dim=8, num_layers=TASK_LAYERS, num_heads=2,
                                      attention=attention, pooling="cls")
    tokens, _, _ = lf.make_far_signal_task(1, TASK_N, 2, 9, MIN_POSITION, seed=0)
    read, _ = lf.class_token_dependence(model, tokens[0], 3)
    read.flags.writeable = False
    return read


@functools.lru_cache(maxsize=None)
def _projections(cls_name):
    """Which outputs the global projections of a tiny layer move."""
    cls = {"real": LongformerAttention, "shared": lf.SharedProjectionLongformer,
           "local_only": lf.LocalOnlyLongformer}[cls_name]
    keras.utils.set_random_seed(0)
    layer = cls(num_heads=2, key_dim=4, window=4, global_tokens=2)
    return lf.global_projection_dependence(layer, 12, 8)


def _results(pattern, reads, accuracy=None, scaling=None, ablation=None, compiled=COMPILED,
             projections=None):
    accuracy = accuracy or {"global": [99.0, 100.0], "local": [24.0, 27.0],
                            "full": [98.0, 100.0]}
    scaling = scaling or {
        "full": {512: {"status": "ok", "median_ms": 40.0, "peak_mib": 60.0},
                 2048: {"status": "ok", "median_ms": 600.0, "peak_mib": 700.0}},
        "longformer": {512: {"status": "ok", "median_ms": 30.0, "peak_mib": 40.0},
                       2048: {"status": "ok", "median_ms": 110.0, "peak_mib": 120.0}},
    }
    measured, expected = pattern
    return {
        "pattern": {"measured": measured, "expected": expected},
        "projections": projections or _projections("real"),
        "reach": {"min_position": MIN_POSITION, "local": reads[0], "global": reads[1]},
        "accuracy": accuracy,
        "chance": 25.0,
        "ablation": ablation,
        "compiled": compiled,
        "scaling": scaling,
    }


# ------------------------------------------------------------ the task


def test_far_signal_task():
    x, y, p = lf.make_far_signal_task(200, 32, 4, 8, 20, seed=3)
    assert x.shape == (200, 32) and x.dtype == np.int32
    assert np.all(p >= 20) and np.all(x[np.arange(200), p] == y + 1)
    signals = (x >= 1) & (x <= 4)
    assert np.all(signals.sum(axis=1) == 1)  # one signal, the rest fillers
    assert set(np.unique(y)) == {0, 1, 2, 3}
    again, _, _ = lf.make_far_signal_task(200, 32, 4, 8, 20, seed=3)
    assert np.array_equal(x, again)
    with pytest.raises(ValueError, match="min_position"):
        lf.make_far_signal_task(4, 16, min_position=16)
    with pytest.raises(ValueError, match="num_classes"):
        lf.make_far_signal_task(4, 16, num_classes=1)


def test_window_schedules_share_the_mean():
    inc = lf.window_schedule("increasing", 4, 16, 128)
    assert inc == [16, 32, 64, 128]
    assert lf.window_schedule("decreasing", 4, 16, 128) == inc[::-1]
    const = lf.window_schedule("constant", 4, 16, 128)
    assert len(set(const)) == 1 and abs(const[0] - np.mean(inc)) <= 2
    dilated = lf.ablation_attention("dilated", 4, 4, 16, 128)
    assert [c["config"]["window"] for c in dilated] == inc
    assert "dilation" not in dilated[0]["config"]
    assert dilated[3]["config"]["dilation"] == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="kind"):
        lf.window_schedule("random", 4, 16, 128)


# -------------------------------------------------------- real layers


def test_expected_masks_follow_the_definition():
    (head1, head2) = lf.expected_head_masks(12, 4, (1, 2), global_positions=(0,))
    assert head1[6].nonzero()[0].tolist() == [0, 4, 5, 6, 7, 8]
    assert head2[6].nonzero()[0].tolist() == [0, 2, 4, 6, 8, 10]
    assert head1[0].all() and head2[:, 0].all()


def test_real_layer_passes():
    pattern = _pattern("real")
    assert np.array_equal(*pattern)
    reads = (_reads("local"), _reads("global"))
    assert not reads[0][MIN_POSITION:].any() and reads[1].all()
    claims = lf.longformer_claims(_results(pattern, reads), MARGINS)
    assert not _failed(claims)
    cl.assert_claims(claims)


def test_planted_global_ignored_fails():
    # Bug: global positions treated as ordinary ones (global_tokens and the
    # call's global_mask ignored). The pattern loses its global row and
    # column, the class token reads only its window, and the "global" model
    # scores like the control.
    pattern = _pattern("local_only")
    assert not np.array_equal(*pattern)
    reads = (_reads("local"), _reads("local_only"))
    assert not reads[1][MIN_POSITION:].any()
    accuracy = {"global": [25.0, 27.0], "local": [24.0, 27.0], "full": [98.0, 100.0]}
    claims = lf.longformer_claims(_results(pattern, reads, accuracy=accuracy), MARGINS)
    assert {"pattern", "reach_global", "global_beats_local"} <= _failed(claims)
    with pytest.raises(cl.ClaimFailure):
        cl.assert_claims(claims)


def test_planted_leaky_control_fails():
    # Bug: a control that can reach the signal (a window wide enough, or a
    # task whose signal stands inside the class token's reach): the reach
    # check fails, and so would the chance check.
    reads = (_reads("leaky"), _reads("global"))
    assert reads[0][MIN_POSITION:].any()
    accuracy = {"global": [99.0, 100.0], "local": [97.0, 99.0], "full": [98.0, 100.0]}
    claims = lf.longformer_claims(_results(_pattern("real"), reads, accuracy=accuracy),
                                  MARGINS)
    assert {"reach_local", "task_local_blind", "global_beats_local"} <= _failed(claims)


def test_planted_dense_swap_fails_on_pattern_and_cost():
    # Bug: the layer swapped for dense attention: every pair is read, memory
    # grows quadratically and nothing is saved against full attention.
    pattern = _pattern("full")
    assert pattern[0].all(axis=0).all()
    reads = (_reads("local"), _reads("global"))
    compiled = {"full": COMPILED["full"], "longformer": COMPILED["full"]}
    claims = {c.name: c for c in lf.longformer_claims(
        _results(pattern, reads, compiled=compiled), MARGINS)}
    assert {"pattern", "memory_linear", "memory_ratio", "flops_ratio"} <= {
        name for name, c in claims.items() if c.failed}
    # The wall-clock and process-memory claims are reported only.
    assert not claims["bench_speed"].asserted and not claims["bench_memory"].asserted


def test_global_projections_are_measured_on_the_layer():
    real = _projections("real")
    assert real["global"] == [0, 1]
    for moved in real["moved"].values():
        assert moved[:2].all() and not moved[2:].any()
    shared = _projections("shared")
    assert not any(moved.any() for moved in shared["moved"].values())
    reads = (_reads("local"), _reads("global"))
    claims = {c.name: c for c in lf.longformer_claims(
        _results(_pattern("real"), reads, projections=shared), MARGINS)}
    assert claims["global_projections"].failed
    claims = {c.name: c for c in lf.longformer_claims(
        _results(_pattern("real"), reads), MARGINS)}
    assert claims["global_projections"].passed and claims["global_projections"].asserted
    with pytest.raises(ValueError, match="global_tokens"):
        lf.global_projection_dependence(LongformerAttention(num_heads=2, key_dim=4, window=4),
                                        8, 8)


def test_planted_task_not_learned_or_unsolvable_fails():
    # Bug: labels that do not follow the signal (nothing to learn): every
    # arm at chance, so the task check and the comparison fail.
    reads = (_reads("local"), _reads("global"))
    accuracy = {"global": [25.0, 26.0], "local": [24.0, 27.0], "full": [25.0, 26.0]}
    claims = lf.longformer_claims(_results(_pattern("real"), reads, accuracy=accuracy),
                                  MARGINS)
    assert {"task_full_solves", "global_beats_local"} <= _failed(claims)


def test_seed_spread_wider_than_the_margin_is_not_testable():
    reads = (_reads("local"), _reads("global"))
    accuracy = {"global": [30.0, 100.0], "local": [24.0, 27.0], "full": [98.0, 100.0]}
    claims = {c.name: c for c in lf.longformer_claims(
        _results(_pattern("real"), reads, accuracy=accuracy), MARGINS)}
    assert claims["global_beats_local"].verdict == cl.NOT_TESTABLE
    assert claims["global_beats_local"].failed


def test_ablation_is_reported_not_asserted():
    reads = (_reads("local"), _reads("global"))
    ablation = {"increasing": [2.50, 2.56], "decreasing": [2.52, 2.55],
                "constant": [2.51, 2.57], "dilated": [2.49, 2.58]}
    claims = {c.name: c for c in lf.longformer_claims(
        _results(_pattern("real"), reads, ablation=ablation), MARGINS)}
    for name in ("ablation_increasing_vs_decreasing", "ablation_increasing_vs_constant",
                 "ablation_dilated_vs_none"):
        assert claims[name].verdict == cl.NOT_TESTABLE and not claims[name].asserted


def test_a_failed_or_skipped_row_is_no_evidence_of_growth():
    # An error, an out-of-memory stop or a skipped length at 4n is not a
    # measurement: the growth claims are then not testable, and fail.
    reads = (_reads("local"), _reads("global"))
    compiled = {
        "full": {256: {"status": "ok", "temp_mib": 2.0, "gflops": 0.03},
                 1024: {"status": "error: XlaRuntimeError", "temp_mib": None,
                        "gflops": None}},
        "longformer": {256: {"status": "ok", "temp_mib": 0.9, "gflops": 0.014},
                       1024: {"status": "skipped", "temp_mib": 3.5, "gflops": 0.055}},
    }
    claims = {c.name: c for c in lf.longformer_claims(
        _results(_pattern("real"), reads, compiled=compiled), MARGINS)}
    for name in ("memory_full_quadratic", "memory_linear"):
        assert claims[name].verdict == cl.NOT_TESTABLE, claims[name]
        assert claims[name].failed
    assert "error" in claims["memory_full_quadratic"].ours
    # The ratios compare the longest n both measured (256 here).
    assert claims["memory_ratio"].ours.startswith("n = 256")
    scaling = {
        "full": {1024: {"status": "ok", "median_ms": 100.0, "peak_mib": 200.0},
                 4096: {"status": "oom", "median_ms": None, "peak_mib": None}},
        "longformer": {1024: {"status": "ok", "median_ms": 50.0, "peak_mib": 50.0},
                       4096: {"status": "ok", "median_ms": 200.0, "peak_mib": 180.0}},
    }
    assert lf.memory_growth(scaling["full"]) == (None, None)
    assert lf.memory_growth(scaling["longformer"]) == (1024, 3.6)
    claims = {c.name: c for c in lf.longformer_claims(
        _results(_pattern("real"), reads, scaling=scaling), MARGINS)}
    assert claims["bench_speed"].ours.startswith("n = 1024")


def test_cost_claims_without_the_compiled_measure_are_not_asserted():
    # On a backend other than JAX the compiled program is not measured.
    reads = (_reads("local"), _reads("global"))
    claims = {c.name: c for c in lf.longformer_claims(
        _results(_pattern("real"), reads, compiled=None), MARGINS)}
    for name in ("memory_linear", "memory_full_quadratic", "memory_ratio", "flops_ratio"):
        assert claims[name].verdict == cl.NOT_TESTABLE and not claims[name].asserted


def test_real_cost_rows_pass_and_a_linear_full_attention_fails():
    reads = (_reads("local"), _reads("global"))
    claims = {c.name: c for c in lf.longformer_claims(
        _results(_pattern("real"), reads), MARGINS)}
    for name in ("memory_linear", "memory_full_quadratic", "memory_ratio", "flops_ratio"):
        assert claims[name].passed and claims[name].asserted, claims[name]
    compiled = {"full": COMPILED["longformer"], "longformer": COMPILED["longformer"]}
    claims = {c.name: c for c in lf.longformer_claims(
        _results(_pattern("real"), reads, compiled=compiled), MARGINS)}
    assert claims["memory_full_quadratic"].failed


def test_ablation_with_some_arms_only():
    reads = (_reads("local"), _reads("global"))
    ablation = {"increasing": [2.50, 2.56], "dilated": [2.49, 2.58]}
    names = {c.name for c in lf.longformer_claims(
        _results(_pattern("real"), reads, ablation=ablation), MARGINS)}
    assert "ablation_dilated_vs_none" in names
    assert "ablation_increasing_vs_decreasing" not in names
