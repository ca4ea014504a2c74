"""Unit tests of the Adaptive Attention Span notebook's claim checks
(``keras_longattn.reproductions.adaptive_span.adaptive_span_claims``) on
typed-in numbers shaped like the notebook's results: every verdict branch
of every claim. These check the check functions; the planted variants that
count (real broken layers trained through the notebook's functions) are
``PLANTED`` in the module, run by ``tests/notebooks/test_planted_real.py``.
"""

import numpy as np
import pytest

from keras_longattn.reproductions import adaptive_span as asp
from keras_longattn.reproductions import claims as cl

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

S = 32
MARGINS = dict(min_head_spread=0.1, max_mean_fraction=0.6, min_flops_ratio=1.2,
               min_memory_ratio=1.2, min_time_ratio=1.2, bpb_margin=0.05)
#: Learned spans of two seeds, (layers, heads): short bottom, longer top.
LEARNED = [np.array([[2.0, 3.0, 1.0, 2.5], [4.0, 20.0, 3.0, 5.0]]),
           np.array([[1.5, 2.0, 2.0, 1.0], [3.0, 18.0, 6.0, 2.0]])]
FROZEN = [np.full((2, 4), float(S))] * 2
#: Every head equal (what a penalty alone gives).
ALIKE = [np.full((2, 4), 9.0)] * 2


def _cost(learned_gflops, max_gflops, learned_mib=2.0, max_mib=4.0, learned_ms=1.0,
          max_ms=2.0):
    return {"learned": {"reach": 20, "gflops": learned_gflops, "temp_mib": learned_mib,
                        "median_ms": learned_ms},
            "max": {"reach": 35, "gflops": max_gflops, "temp_mib": max_mib,
                    "median_ms": max_ms},
            "layers": []}


SAVED = [_cost(0.5, 1.0), _cost(0.55, 1.0)]
NOT_SAVED = [_cost(1.0, 1.0, 4.0, 4.0, 2.0, 2.0)] * 2


def _claims(spans=LEARNED, costs=SAVED, bits=None, margins=MARGINS):
    bits = bits if bits is not None else {"adaptive": [2.50, 2.52], "fixed": [2.51, 2.53]}
    return {c.name: c for c in asp.adaptive_span_claims(
        {"max_span": S, "spans": spans, "bits": bits, "costs": costs}, margins)}


def test_claim_names_are_stable():
    assert list(_claims()) == ["spans_differ", "mean_span_below_max", "flops_saved",
                               "memory_saved", "time_saved", "bpb_vs_fixed",
                               "upper_layers_longer", "few_long_heads"]


def test_learned_spans_pass_every_asserted_claim():
    claims = _claims()
    asserted = {name for name, c in claims.items() if c.asserted}
    assert asserted == {"spans_differ", "mean_span_below_max", "flops_saved"}
    for name in asserted:
        assert claims[name].verdict == cl.REPRODUCED, claims[name]
    cl.assert_claims(claims.values())


def test_spans_at_the_maximum_fail_the_span_and_cost_claims():
    claims = _claims(spans=FROZEN, costs=NOT_SAVED)
    failed = {name for name, c in claims.items() if c.failed}
    assert failed == {"spans_differ", "mean_span_below_max", "flops_saved"}
    assert claims["memory_saved"].verdict == cl.NOT_REPRODUCED
    assert claims["time_saved"].verdict == cl.NOT_REPRODUCED
    with pytest.raises(cl.ClaimFailure, match="spans_differ"):
        cl.assert_claims(claims.values())


def test_spans_alike_in_every_head_fail_only_spans_differ():
    claims = _claims(spans=ALIKE)
    assert {name for name, c in claims.items() if c.failed} == {"spans_differ"}
    assert "0.000" in claims["spans_differ"].ours


def test_a_small_flop_saving_fails():
    claims = _claims(costs=[_cost(0.9, 1.0)] * 2)
    assert claims["flops_saved"].verdict == cl.NOT_REPRODUCED
    assert claims["flops_saved"].failed


def test_without_compiled_costs_the_flop_claim_is_not_asserted():
    claims = _claims(costs=None)
    flops = claims["flops_saved"]
    assert flops.verdict == cl.NOT_TESTABLE and not flops.asserted
    assert "memory_saved" not in claims and "time_saved" not in claims
    cl.assert_claims(claims.values())


def test_memory_and_time_ratios_direction_only():
    claims = _claims(costs=[_cost(0.5, 1.0, 3.0, 3.3, 1.0, 1.1)] * 2)
    assert claims["memory_saved"].verdict == cl.DIRECTION_ONLY
    assert claims["time_saved"].verdict == cl.DIRECTION_ONLY
    assert not claims["memory_saved"].asserted and not claims["time_saved"].asserted


def test_bits_per_byte_comparison_branches():
    assert _claims()["bpb_vs_fixed"].verdict == cl.REPRODUCED
    behind = _claims(bits={"adaptive": [2.70, 2.71], "fixed": [2.50, 2.51]})["bpb_vs_fixed"]
    assert behind.verdict == cl.NOT_REPRODUCED and not behind.failed
    noisy = _claims(bits={"adaptive": [2.4, 2.6], "fixed": [2.5, 2.5]})["bpb_vs_fixed"]
    assert noisy.verdict == cl.NOT_TESTABLE
    missing = _claims(bits={"adaptive": [2.5]})["bpb_vs_fixed"]
    assert missing.verdict == cl.NOT_TESTABLE and not missing.asserted


def test_upper_layer_and_short_head_branches():
    claims = _claims()
    assert claims["upper_layers_longer"].verdict == cl.REPRODUCED
    assert claims["few_long_heads"].verdict == cl.REPRODUCED
    flipped = [s[::-1] for s in LEARNED]
    assert _claims(spans=flipped)["upper_layers_longer"].verdict == cl.NOT_REPRODUCED
    mixed = [LEARNED[0], LEARNED[1][::-1]]
    assert _claims(spans=mixed)["upper_layers_longer"].verdict == cl.DIRECTION_ONLY
    one_layer = [s[:1] for s in LEARNED]
    assert _claims(spans=one_layer)["upper_layers_longer"].verdict == cl.NOT_TESTABLE
    assert _claims(spans=FROZEN)["few_long_heads"].verdict == cl.NOT_REPRODUCED


def test_span_summary_on_typed_in_spans():
    summary = asp.span_summary(LEARNED[0], S)
    assert summary["mean_fraction"] == pytest.approx(LEARNED[0].mean() / S)
    assert summary["head_spread_fraction"] == pytest.approx(19.0 / S)
    assert summary["max_fraction"] == pytest.approx(20.0 / S)
    assert summary["layer_means"] == pytest.approx([2.125, 8.0])
    # Under a quarter of the longest (5.0): 6 of the 8 heads.
    assert summary["short_share"] == pytest.approx(6 / 8)
    zeros = asp.span_summary(np.zeros((1, 3)), S)
    assert zeros["short_share"] == 1.0 and zeros["head_spread_fraction"] == 0.0


def test_planted_set_targets_the_asserted_claims():
    asserted = {name for name, c in _claims().items() if c.asserted}
    targeted = set()
    for variant in asp.PLANTED.variants:
        targeted |= set(variant.claims)
        assert set(variant.claims) <= asserted, variant.name
    assert targeted == asserted
