"""Unit tests of the longify notebook's claim checks
(``keras_longattn.reproductions.longify.longify_claims``) on typed-in
numbers shaped like the notebook's results: every verdict branch. These
check the check function; the planted variants that count (real broken
conversions trained through the notebook's functions) are ``PLANTED`` in
the module, run by ``tests/notebooks/test_planted_real.py``."""

import copy

import pytest

from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import longify as lg

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

MARGINS = dict(max_output_difference=1e-4, copy_margin=20.0, accuracy_margin=20.0,
               min_long_accuracy=60.0, max_blind_excess=15.0, min_memory_ratio=2.0,
               min_flops_ratio=1.5, min_speedup=1.5)
COMPILED = {
    "full": {512: {"status": "ok", "temp_mib": 20.0, "gflops": 1.0, "median_ms": 30.0},
             1024: {"status": "ok", "temp_mib": 80.0, "gflops": 4.0, "median_ms": 100.0}},
    "local": {512: {"status": "ok", "temp_mib": 4.0, "gflops": 0.5, "median_ms": 10.0},
              1024: {"status": "ok", "temp_mib": 8.0, "gflops": 1.0, "median_ms": 20.0}},
    "longformer": {512: {"status": "ok", "temp_mib": 5.0, "gflops": 0.6, "median_ms": 12.0},
                   1024: {"status": "ok", "temp_mib": 10.0, "gflops": 1.2, "median_ms": 25.0}},
}
REAL = {
    "differences": {"roberta_local": 0.0, "roberta_longformer": 2e-7, "gpt2_local": 0.0},
    "generation": {"equal": True, "first_difference": None},
    "copy_init": {"copied": [95.0, 96.0], "dropped": [55.0, 53.0], "short": [96.0, 97.0]},
    "accuracy": {"truncated": [27.0, 27.0], "local": [24.0, 26.0],
                 "longformer": [95.0, 99.0]},
    "zero_shot": {"local": [25.0, 25.0], "longformer": [92.0, 92.0]},
    "chance": 25.0,
    "compiled": COMPILED,
}
ASSERTED = {"outputs_match", "copy_init", "truncated_blind", "longformer_solves",
            "longformer_beats_local", "memory_ratio", "flops_ratio"}


def _claims(**changes):
    results = copy.deepcopy(REAL)
    results.update(changes)
    return {c.name: c for c in lg.longify_claims(results, MARGINS)}


def test_real_numbers_pass_and_the_asserted_set_is_stable():
    claims = _claims()
    assert {n for n, c in claims.items() if c.asserted} == ASSERTED
    assert all(c.verdict == cl.REPRODUCED for n, c in claims.items() if n in ASSERTED)
    cl.assert_claims(claims.values())
    assert claims["speedup"].verdict == cl.REPRODUCED and not claims["speedup"].asserted
    assert "8.0x" in claims["memory_ratio"].ours and "1024" in claims["memory_ratio"].ours


def test_outputs_differ():
    claims = _claims(differences={"roberta_local": 0.0, "gpt2_local": 3e-2})
    assert claims["outputs_match"].failed
    with pytest.raises(cl.ClaimFailure, match="outputs_match"):
        cl.assert_claims(claims.values())


def test_generation_is_reported_either_way():
    claims = _claims(generation={"equal": False, "first_difference": 12})
    assert claims["generation_match"].verdict == cl.NOT_REPRODUCED
    assert not claims["generation_match"].failed and "12" in claims["generation_match"].ours
    assert _claims(generation=None)["generation_match"].verdict == cl.NOT_TESTABLE


@pytest.mark.parametrize("copied, verdict", [
    ([60.0, 62.0], cl.DIRECTION_ONLY),
    ([50.0, 52.0], cl.NOT_REPRODUCED),
    ([95.0, 40.0], cl.NOT_TESTABLE),
])
def test_copy_init_branches(copied, verdict):
    copy_init = {"copied": copied, "dropped": [55.0, 53.0], "short": [96.0, 97.0]}
    claims = _claims(copy_init=copy_init)
    assert claims["copy_init"].verdict == verdict
    assert claims["copy_init"].failed
    assert claims["copy_init_keeps_skill"].verdict in (cl.NOT_REPRODUCED, cl.NOT_TESTABLE)
    assert not claims["copy_init_keeps_skill"].failed


def test_truncated_model_that_sees_the_answer():
    accuracy = copy.deepcopy(REAL["accuracy"])
    accuracy["truncated"] = [60.0, 60.0]
    assert _claims(accuracy=accuracy)["truncated_blind"].failed


@pytest.mark.parametrize("longformer, local, failed, verdict", [
    ([24.0, 26.0], [24.0, 26.0], {"longformer_solves", "longformer_beats_local"},
     cl.NOT_REPRODUCED),
    ([70.0, 72.0], [55.0, 57.0], {"longformer_beats_local"}, cl.DIRECTION_ONLY),
    ([95.0, 99.0], [24.0, 70.0], {"longformer_beats_local"}, cl.NOT_TESTABLE),
])
def test_task_branches(longformer, local, failed, verdict):
    accuracy = {"truncated": [27.0, 27.0], "local": local, "longformer": longformer}
    claims = _claims(accuracy=accuracy)
    assert {n for n, c in claims.items() if c.failed} == failed
    assert claims["longformer_beats_local"].verdict == verdict


def test_local_blind_is_reported():
    accuracy = copy.deepcopy(REAL["accuracy"])
    accuracy["local"] = [50.0, 50.0]
    claims = _claims(accuracy=accuracy)
    assert claims["local_blind"].verdict == cl.NOT_REPRODUCED
    assert not claims["local_blind"].failed


def test_cost_branches():
    dense = copy.deepcopy(COMPILED)
    dense["longformer"] = copy.deepcopy(dense["full"])
    claims = _claims(compiled=dense)
    assert claims["memory_ratio"].failed and claims["flops_ratio"].failed
    assert claims["speedup"].verdict == cl.NOT_REPRODUCED and not claims["speedup"].failed
    broken = copy.deepcopy(COMPILED)
    for n in broken["longformer"]:
        broken["longformer"][n] = {"status": "error: oom", "temp_mib": None, "gflops": None}
    claims = _claims(compiled=broken)
    assert claims["memory_ratio"].failed and "no length compiled" in claims["memory_ratio"].ours
    assert claims["speedup"].verdict == cl.NOT_TESTABLE
    slow = copy.deepcopy(COMPILED)
    slow["longformer"][1024]["median_ms"] = 80.0
    assert _claims(compiled=slow)["speedup"].verdict == cl.DIRECTION_ONLY
    untimed = copy.deepcopy(COMPILED)
    for rows in untimed.values():
        for row in rows.values():
            row["median_ms"] = None
    assert _claims(compiled=untimed)["speedup"].verdict == cl.NOT_TESTABLE


def test_not_measured_off_jax():
    claims = _claims(compiled=None)
    for name in ("memory_ratio", "flops_ratio", "speedup"):
        assert claims[name].verdict == cl.NOT_TESTABLE and not claims[name].asserted
    cl.assert_claims(claims.values())


def test_planted_set_targets_every_asserted_claim():
    targeted = {name for v in lg.PLANTED.variants for name in v.claims}
    assert targeted == ASSERTED
    assert set(lg.VARIANT_MEASURES) == {v.name for v in lg.PLANTED.variants}
    with pytest.raises(ValueError, match="variant"):
        lg._planted_run("nonsense")
