"""Unit tests of the Sandwich Transformer notebook's claim checks
(``keras_longattn.reproductions.sandwich_transformer.sandwich_claims``) on
typed-in numbers shaped like the notebook's results: every verdict of every
claim. These check the check functions; the planted variants that count
(real broken model builders trained through the notebook's functions) are
``PLANTED`` in the module, run by ``tests/notebooks/test_planted_real.py``.
"""

import pytest

from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import sandwich_transformer as sw

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

MARGINS = dict(bpb_margin=0.02, digits_margin=0.02, min_rho=0.5)
PATTERNS = {"interleaved": "sfsfsf", "sandwich_1": "ssfsff", "sandwich_2": "sssfff"}


def _structures(rows=None, params=1000):
    rows = rows or {arm: (p, p, params) for arm, p in PATTERNS.items()}
    return {arm: {"requested": r, "measured": m, "params": n}
            for arm, (r, m, n) in rows.items()}


def _results(lm=None, efficient=None, digits=None, structures=None, patterns=PATTERNS):
    lm = lm or {"interleaved": [5.00, 5.01], "sandwich_1": [4.95, 4.96],
                "sandwich_2": [4.90, 4.91]}
    return {
        "structures": structures or {"lm": _structures(),
                                     "efficient": _structures({
                                         "interleaved": ("sfsfsf", "sfsfsf", 1006),
                                         "sandwich_1": ("ssfsff", "ssfsff", 1006)}),
                                     "digits": {}},
        "patterns": patterns, "sandwich_arm": "sandwich_1", "lm": lm,
        "efficient": efficient, "efficient_name": "adaptive-span attention",
        "digits": digits,
    }


def _by_name(claims):
    return {c.name: c for c in claims}


def test_real_shaped_results_pass_and_only_structure_is_asserted():
    claims = _by_name(sw.sandwich_claims(_results(), MARGINS))
    assert claims["same_parameters"].verdict == cl.REPRODUCED
    assert "equal in all 5 models (lm 1,000, efficient 1,006)" in claims["same_parameters"].ours
    assert claims["order_as_requested"].verdict == cl.REPRODUCED
    assert {c.name for c in claims.values() if c.asserted} == {"same_parameters",
                                                              "order_as_requested"}
    cl.assert_claims(claims.values())


def test_a_changed_parameter_count_fails():
    structures = {"lm": _structures({"interleaved": ("sfsfsf", "sfsfsf", 1000),
                                     "sandwich_1": ("ssfsff", "ssfsf", 900)})}
    claims = _by_name(sw.sandwich_claims(_results(structures=structures), MARGINS))
    c = claims["same_parameters"]
    assert c.verdict == cl.NOT_REPRODUCED and c.failed
    assert "lm/sandwich_1: 900 vs 1,000" in c.ours
    with pytest.raises(cl.ClaimFailure, match="same_parameters"):
        cl.assert_claims(claims.values())


def test_a_count_is_compared_within_its_section_only():
    # Adaptive span adds a few weights: another section, another reference.
    structures = {"lm": _structures(), "efficient": _structures(params=1006)}
    claims = _by_name(sw.sandwich_claims(_results(structures=structures), MARGINS))
    assert claims["same_parameters"].verdict == cl.REPRODUCED
    structures["efficient"]["sandwich_2"]["params"] = 1000
    claims = _by_name(sw.sandwich_claims(_results(structures=structures), MARGINS))
    assert claims["same_parameters"].verdict == cl.NOT_REPRODUCED
    assert "efficient/sandwich_2" in claims["same_parameters"].ours


def test_an_ignored_pattern_fails_the_order_claim_only():
    structures = {"lm": _structures({arm: (p, "sfsfsf", 1000) for arm, p in PATTERNS.items()})}
    claims = _by_name(sw.sandwich_claims(_results(structures=structures), MARGINS))
    assert claims["same_parameters"].verdict == cl.REPRODUCED
    c = claims["order_as_requested"]
    assert c.verdict == cl.NOT_REPRODUCED and c.failed
    assert "lm/sandwich_1: asked ssfsff, built sfsfsf" in c.ours
    assert "lm/interleaved" not in c.ours


def test_no_model_measured_fails_both_structure_claims():
    claims = _by_name(sw.sandwich_claims(_results(structures={"lm": {}, "digits": None}),
                                         MARGINS))
    for name in ("same_parameters", "order_as_requested"):
        assert claims[name].verdict == cl.NOT_REPRODUCED
        assert claims[name].ours == "no model measured"


@pytest.mark.parametrize("sandwich, interleaved, verdict", [
    ([4.95, 4.96], [5.00, 5.01], cl.REPRODUCED),        # 0.05 fewer bits, spread 0.01
    ([4.99, 5.00], [5.00, 5.01], cl.DIRECTION_ONLY),    # 0.01 fewer
    ([5.05, 5.06], [5.00, 5.01], cl.NOT_REPRODUCED),    # more bits
    ([4.90, 4.96], [5.00, 5.01], cl.NOT_TESTABLE),      # spread 0.06 >= margin
])
def test_lm_sandwich_verdicts(sandwich, interleaved, verdict):
    lm = {"interleaved": interleaved, "sandwich_1": sandwich}
    claims = _by_name(sw.sandwich_claims(
        _results(lm=lm, patterns={"interleaved": "sfsfsf", "sandwich_1": "ssfsff"}), MARGINS))
    c = claims["lm_sandwich_beats_interleaved"]
    assert c.verdict == verdict and not c.asserted
    assert "18.40 -> 17.96" in c.paper
    # Only one sandwich: no best-of claim, and two depths: depth not testable.
    assert "lm_best_sandwich_beats_interleaved" not in claims
    assert claims["lm_attention_bottom"].verdict == cl.NOT_TESTABLE


def test_best_sandwich_is_chosen_after_the_fact():
    lm = {"interleaved": [5.00, 5.01], "sandwich_1": [5.02, 5.03], "sandwich_2": [4.90, 4.91]}
    claims = _by_name(sw.sandwich_claims(_results(lm=lm), MARGINS))
    assert claims["lm_sandwich_beats_interleaved"].verdict == cl.NOT_REPRODUCED
    best = claims["lm_best_sandwich_beats_interleaved"]
    assert best.verdict == cl.REPRODUCED and not best.asserted
    assert "sandwich_2" in best.statement and "after the fact" in best.statement


# Attention depths: sandwich_2 0.2 < sandwich_1 0.27 < interleaved 0.4.
@pytest.mark.parametrize("means, rho, verdict", [
    ((5.00, 4.95, 4.90), 1.0, cl.REPRODUCED),       # less attention depth, fewer bits
    ((5.00, 4.90, 4.95), 0.5, cl.REPRODUCED),       # rho at min_rho
    ((4.95, 4.90, 5.00), -0.5, cl.NOT_REPRODUCED),  # mostly the other way
    ((4.90, 4.95, 5.00), -1.0, cl.NOT_REPRODUCED),  # attention at the bottom does worse
])
def test_attention_depth_verdicts(means, rho, verdict):
    lm = {arm: [m, m + 0.001] for arm, m in zip(PATTERNS, means)}
    c = _by_name(sw.sandwich_claims(_results(lm=lm), MARGINS))["lm_attention_bottom"]
    assert c.verdict == verdict and not c.asserted
    assert f"rank correlation {rho:+.2f} over 3 orderings" in c.ours


def test_attention_depth_direction_only_and_not_testable():
    patterns = {"interleaved": "sfsfsf", "sandwich_1": "ssfsff", "sandwich_2": "sssfff",
                "random_0": "ffssfs"}
    # depths: interleaved 0.4, k=1 0.27, k=2 0.2, random 0.67; rho 0.4 with these means
    lm = {"interleaved": [5.00, 5.001], "sandwich_1": [4.95, 4.951],
          "sandwich_2": [5.02, 5.021], "random_0": [5.03, 5.031]}
    results = _results(lm=lm, patterns=patterns)
    results["structures"] = {"lm": _structures({a: (p, p, 1) for a, p in patterns.items()})}
    c = _by_name(sw.sandwich_claims(results, MARGINS))["lm_attention_bottom"]
    assert c.verdict == cl.DIRECTION_ONLY, c.ours
    # A seed spread as large as the range of the means: not testable.
    lm["sandwich_1"] = [4.90, 5.10]
    c = _by_name(sw.sandwich_claims(results, MARGINS))["lm_attention_bottom"]
    assert c.verdict == cl.NOT_TESTABLE


@pytest.mark.parametrize("sandwich, verdict", [
    ([4.95, 4.96], cl.REPRODUCED), ([4.995, 5.005], cl.DIRECTION_ONLY),
    ([5.10, 5.11], cl.NOT_REPRODUCED), ([4.90, 5.00], cl.NOT_TESTABLE)])
def test_efficient_and_digits_verdicts(sandwich, verdict):
    pair = {"interleaved": [5.00, 5.01], "sandwich_1": sandwich}
    claims = _by_name(sw.sandwich_claims(_results(efficient=pair, digits=pair), MARGINS))
    for name in ("efficient_sandwich_beats_interleaved", "digits_sandwich_beats_interleaved"):
        assert claims[name].verdict == verdict and not claims[name].asserted
    assert "adaptive-span attention" in claims["efficient_sandwich_beats_interleaved"].statement
    assert "0.975 -> 0.968" in claims["efficient_sandwich_beats_interleaved"].paper


def test_skipped_sections_give_no_claim():
    names = {c.name for c in sw.sandwich_claims(_results(), MARGINS)}
    assert "efficient_sandwich_beats_interleaved" not in names
    assert "digits_sandwich_beats_interleaved" not in names


def test_planted_variants_target_asserted_claims():
    names = {c.name for c in sw.sandwich_claims(_results(), MARGINS) if c.asserted}
    for variant in sw.PLANTED.variants:
        assert set(variant.claims) <= names, variant.name
    with pytest.raises(ValueError, match="variant"):
        sw.PLANTED.run("nonsense")
