"""Unit tests of the MPNet notebook's claim checks
(``keras_longattn.reproductions.mpnet.mpnet_claims``) on typed-in numbers
shaped like the notebook's results: every verdict branch. These check the
check function; the planted variants that count (real broken models trained
through the notebook's functions) are ``PLANTED`` in the module, run by
``tests/notebooks/test_planted_real.py``."""

import numpy as np
import pytest

from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import mpnet as mp

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

MARGINS = dict(leak_tolerance=1e-5, min_dependence=1e-3, min_bits_drop=1.0,
               accuracy_margin=2.0, downstream_margin=2.0)
ASSERTED = {"query_no_leak", "position_compensation", "trainable"}


def _results(**changes):
    results = {
        "leak": {"plm": {"own": np.zeros(4), "later": np.array([0.02, 0.01, 0.03])},
                 "mpnet": {"own": np.zeros(4), "later": np.array([0.02, 0.015, 0.01])}},
        "position": {"mlm": 0.01, "plm": 0.0, "mpnet": 0.02},
        "scores": {
            "mlm": {"bits": [4.0, 4.1], "accuracy": [30.0, 31.0], "first_accuracy": [28.0, 29.0]},
            "plm": {"bits": [3.9, 4.0], "accuracy": [33.0, 34.0], "first_accuracy": [24.0, 25.0]},
            "mpnet": {"bits": [3.8, 3.9], "accuracy": [37.0, 38.0],
                      "first_accuracy": [28.5, 29.0]},
        },
        "initial": {o: {"bits": [8.1, 8.0]} for o in ("mlm", "plm", "mpnet")},
        "downstream": {"mlm": [70.0, 71.0], "plm": [72.0, 72.5], "mpnet": [75.0, 76.0],
                       "scratch": [60.0, 61.0]},
    }
    results.update(changes)
    return results


def _by_name(claims):
    return {c.name: c for c in claims}


def test_the_real_shape_passes_and_the_names_are_stable():
    claims = _by_name(mp.mpnet_claims(_results(), MARGINS))
    assert set(claims) == ASSERTED | {
        "held_out_mpnet_vs_plm", "first_mpnet_vs_mlm", "first_mlm_vs_plm",
        "downstream_mpnet_vs_mlm", "downstream_mpnet_vs_plm",
        "downstream_pretrained_vs_scratch"}
    assert {n for n, c in claims.items() if c.asserted} == ASSERTED
    assert all(claims[n].verdict == cl.REPRODUCED for n in ASSERTED)
    cl.assert_claims(claims.values())
    assert claims["held_out_mpnet_vs_plm"].verdict == cl.REPRODUCED
    assert claims["first_mlm_vs_plm"].verdict == cl.REPRODUCED
    assert claims["first_mpnet_vs_mlm"].verdict == cl.DIRECTION_ONLY
    assert claims["downstream_mpnet_vs_plm"].verdict == cl.REPRODUCED
    assert "87.7" in claims["downstream_mpnet_vs_mlm"].paper
    assert "83.1" in claims["downstream_mpnet_vs_mlm"].paper


@pytest.mark.parametrize("objective", ["plm", "mpnet"])
def test_a_query_stream_that_sees_its_own_token_fails(objective):
    leak = _results()["leak"]
    leak[objective] = {"own": np.array([0.0, 0.04, 0.0, 0.0]),
                       "later": leak[objective]["later"]}
    claims = _by_name(mp.mpnet_claims(_results(leak=leak), MARGINS))
    assert claims["query_no_leak"].failed
    assert "4.0e-02" in claims["query_no_leak"].ours
    with pytest.raises(cl.ClaimFailure, match="query_no_leak"):
        cl.assert_claims(claims.values())


def test_a_perturbation_that_reaches_nothing_fails_the_leak_check():
    # Own prediction unchanged but the later ones too: the probe changed
    # nothing the model reads, which is no evidence of a clean query stream.
    leak = _results()["leak"]
    leak["mpnet"] = {"own": np.zeros(4), "later": np.array([0.02, 0.0, 0.01])}
    assert _by_name(mp.mpnet_claims(_results(leak=leak), MARGINS))["query_no_leak"].failed
    leak["mpnet"] = {"own": np.zeros(1), "later": np.zeros(0)}
    assert _by_name(mp.mpnet_claims(_results(leak=leak), MARGINS))["query_no_leak"].failed


def test_position_compensation_branches():
    for position, fails in (({"plm": 0.0, "mpnet": 0.02}, False),
                            ({"plm": 0.0, "mpnet": 0.0}, True),   # no compensation
                            ({"plm": 0.01, "mpnet": 0.02}, True),  # PLM sees positions
                            ({"plm": 0.0, "mpnet": 5e-4}, True)):  # below min_dependence
        claim = _by_name(mp.mpnet_claims(_results(position=position), MARGINS))[
            "position_compensation"]
        assert claim.failed is fails, (position, claim.ours)
        assert "mlm" not in claim.ours


def test_an_objective_that_does_not_learn_fails_trainable():
    scores = _results()["scores"]
    scores["plm"] = dict(scores["plm"], bits=[7.9, 7.6])
    claim = _by_name(mp.mpnet_claims(_results(scores=scores), MARGINS))["trainable"]
    assert claim.failed and "plm" in claim.detail
    # A drop of exactly the margin passes.
    scores["plm"] = dict(scores["plm"], bits=[7.1, 7.0])
    claim = _by_name(mp.mpnet_claims(_results(scores=scores), MARGINS))["trainable"]
    assert not claim.failed


def test_held_out_comparisons_are_reported_with_every_verdict():
    scores = _results()["scores"]
    cases = (([37.0, 38.0], cl.REPRODUCED), ([34.0, 35.0], cl.DIRECTION_ONLY),
             ([32.0, 33.0], cl.NOT_REPRODUCED), ([30.0, 40.0], cl.NOT_TESTABLE))
    for accuracy, verdict in cases:
        scores["mpnet"] = dict(scores["mpnet"], accuracy=accuracy)
        claim = _by_name(mp.mpnet_claims(_results(scores=scores), MARGINS))[
            "held_out_mpnet_vs_plm"]
        assert claim.verdict == verdict and not claim.asserted and not claim.failed


def test_downstream_not_learned_is_not_testable():
    down = {"mlm": [50.0, 50.0], "plm": [49.0, 50.5], "mpnet": [49.0, 50.0],
            "scratch": [47.0, 48.0]}
    claims = _by_name(mp.mpnet_claims(_results(downstream=down), MARGINS))
    for name in ("downstream_mpnet_vs_mlm", "downstream_mpnet_vs_plm",
                 "downstream_pretrained_vs_scratch"):
        assert claims[name].verdict == cl.NOT_TESTABLE, name
        assert "chance" in claims[name].detail
    # Learned by one arm: the comparisons get their ordinary verdicts.
    down["scratch"] = [60.0, 60.5]
    claims = _by_name(mp.mpnet_claims(_results(downstream=down), MARGINS))
    assert claims["downstream_pretrained_vs_scratch"].verdict == cl.NOT_REPRODUCED
    assert claims["downstream_mpnet_vs_mlm"].verdict == cl.NOT_REPRODUCED


def test_skipped_downstream_and_missing_mlm_make_no_claims_on_them():
    results = _results(downstream=None)
    for key in ("scores", "initial"):
        results[key] = {o: v for o, v in results[key].items() if o != "mlm"}
    names = set(_by_name(mp.mpnet_claims(results, MARGINS)))
    assert names == ASSERTED | {"held_out_mpnet_vs_plm"}


def test_the_planted_set_targets_asserted_claims():
    assert mp.PLANTED.slug == "mpnet"
    names = {v.name for v in mp.PLANTED.variants}
    assert names == set(mp.VARIANTS) == set(mp.VARIANT_OBJECTIVES)
    for variant in mp.PLANTED.variants:
        assert set(variant.claims) <= ASSERTED
    assert {c for v in mp.PLANTED.variants for c in v.claims} == ASSERTED
    with pytest.raises(ValueError, match="variant"):
        mp._planted_run("nonsense")
