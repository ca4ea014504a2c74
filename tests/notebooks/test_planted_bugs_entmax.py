"""Unit tests of the entmax notebook's claim checks
(``keras_longattn.reproductions.entmax.entmax_claims``) on typed-in numbers
shaped like the notebook's results: every verdict of every claim. These
check the check functions; the planted variants that count (real broken
layers trained through the notebook's functions) are ``PLANTED`` in the
module, run by ``tests/notebooks/test_planted_real.py``."""

import numpy as np
import pytest

from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import entmax as em

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

MARGINS = dict(min_softmax_accuracy=0.8, accuracy_margin=0.1, min_zero_share=0.2,
               max_softmax_zero_share=0.01, min_alpha_move=0.02, min_alpha_spread=0.02,
               mask_tolerance=1e-5, near_softmax=1.25, near_sparsemax=1.75)
CLEAN_MASK = {"masked_weight": 0.0, "row_error": 1e-7, "output_change": 0.0}


def _arm(accuracy, zeros, alpha_start=None, alpha_end=None):
    """An arm of two seeds, 2 layers x 2 heads: ``zeros`` and the α are one
    (2, 2) matrix per seed (or a number for every head)."""
    def per_seed(value, default):
        value = default if value is None else value
        return [np.broadcast_to(np.asarray(v, float), (2, 2)).copy() for v in value]

    return {"accuracy": list(accuracy), "zeros": per_seed(zeros, None),
            "alpha_start": per_seed(alpha_start, [1.5, 1.5]),
            "alpha_end": per_seed(alpha_end, [1.5, 1.5]), "seconds": [1.0, 1.0]}


GOOD_ALPHA = [[[1.45, 1.52], [1.48, 1.56]], [[1.47, 1.50], [1.44, 1.53]]]


def _results(**change):
    arms = {
        "softmax": _arm([1.0, 0.98], [0.0, 0.0], alpha_start=[1.0, 1.0],
                        alpha_end=[1.0, 1.0]),
        "entmax15": _arm([0.99, 1.0], [0.7, 0.65]),
        "learned": _arm([1.0, 0.97], [[[0.5, 0.7], [0.6, 0.8]], 0.7], alpha_end=GOOD_ALPHA),
    }
    arms.update({k: v for k, v in change.items() if k in arms})
    mask = {arm: dict(CLEAN_MASK) for arm in em.ARMS}
    mask.update(change.get("mask", {}))
    return {"arms": arms, "chance": 0.125, "mask": mask}


def _claims(**change):
    return {c.name: c for c in em.entmax_claims(_results(**change), MARGINS)}


ASSERTED = {"mask_respected", "softmax_solves", "parity_entmax15", "parity_learned",
            "softmax_dense", "zeros_entmax15", "zeros_learned", "alpha_moves",
            "alpha_spread"}


def test_real_shaped_numbers_pass_every_asserted_claim():
    claims = _claims()
    assert {n for n, c in claims.items() if c.asserted} == ASSERTED
    assert all(c.verdict == cl.REPRODUCED for n, c in claims.items() if n in ASSERTED)
    cl.assert_claims(claims.values())
    # Reported only: on a task both solve, no gain of the learned α, and no
    # head reaches either end of (1, 2).
    assert claims["learned_beats_entmax15"].verdict == cl.NOT_REPRODUCED
    assert claims["alpha_census"].verdict == cl.NOT_REPRODUCED
    assert claims["zeros_differ_by_head"].verdict == cl.REPRODUCED
    assert not claims["alpha_census"].asserted


def test_alpha_stuck_at_one_fails_the_alpha_and_zero_claims():
    stuck = _arm([1.0, 1.0], [0.0, 0.0], alpha_start=[1.0, 1.0], alpha_end=[1.0, 1.0])
    claims = _claims(learned=stuck)
    for name in ("alpha_moves", "alpha_spread", "zeros_learned"):
        assert claims[name].failed, name
    assert not claims["parity_learned"].failed


def test_alpha_moving_in_one_seed_only_fails():
    one_seed = _arm([1.0, 1.0], [0.6, 0.6], alpha_end=[GOOD_ALPHA[0], [[1.5] * 2] * 2])
    claims = _claims(learned=one_seed)
    assert claims["alpha_moves"].failed and claims["alpha_spread"].failed
    assert "0.000" in claims["alpha_moves"].ours
    # Every head moving by the same amount moves α but spreads nothing.
    shifted = _arm([1.0, 1.0], [0.6, 0.6], alpha_end=[1.6, 1.6])
    claims = _claims(learned=shifted)
    assert not claims["alpha_moves"].failed and claims["alpha_spread"].failed


def test_parity_verdicts():
    behind = _claims(entmax15=_arm([0.5, 0.52], [0.7, 0.7]))["parity_entmax15"]
    assert behind.verdict == cl.NOT_REPRODUCED and behind.failed
    noisy = _claims(learned=_arm([1.0, 0.6], [0.7, 0.7], alpha_end=GOOD_ALPHA))
    assert noisy["parity_learned"].verdict == cl.NOT_TESTABLE and noisy["parity_learned"].failed
    slightly = _claims(entmax15=_arm([0.93, 0.93], [0.7, 0.7]))["parity_entmax15"]
    assert slightly.verdict == cl.REPRODUCED  # behind by 0.06 < 0.1


def test_learned_against_entmax15_is_reported_with_every_verdict():
    ahead = _claims(entmax15=_arm([0.5, 0.5], [0.7, 0.7]))["learned_beats_entmax15"]
    assert ahead.verdict == cl.REPRODUCED and not ahead.asserted
    little = _claims(entmax15=_arm([0.95, 0.94], [0.7, 0.7]))["learned_beats_entmax15"]
    assert little.verdict == cl.DIRECTION_ONLY


def test_task_check_and_softmax_zeros():
    claims = _claims(softmax=_arm([0.3, 0.35], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]))
    assert claims["softmax_solves"].failed
    sparse_control = _arm([1.0, 1.0], [0.7, 0.6], [1.5, 1.5], [1.5, 1.5])
    claims = _claims(softmax=sparse_control)
    assert claims["softmax_dense"].failed and "0.7000" in claims["softmax_dense"].ours
    underflow = _arm([1.0, 1.0], [[[0.0, 0.005], [0.0, 0.0]], 0.0], [1.0, 1.0], [1.0, 1.0])
    assert not _claims(softmax=underflow)["softmax_dense"].failed


def test_entmax_without_zeros_fails():
    claims = _claims(entmax15=_arm([1.0, 1.0], [0.05, 0.1]))
    assert claims["zeros_entmax15"].failed
    assert not claims["zeros_learned"].failed


@pytest.mark.parametrize("field", ["masked_weight", "row_error", "output_change"])
def test_mask_probe_failures(field):
    leaky = dict(CLEAN_MASK, **{field: 0.3})
    claims = _claims(mask={"learned": leaky})
    assert claims["mask_respected"].failed
    assert "learned: " in claims["mask_respected"].ours


def test_census_counts_heads_at_both_ends():
    spread = _arm([1.0, 1.0], [0.6, 0.6], alpha_end=[[[1.1, 1.9], [1.5, 1.5]]] * 2)
    census = _claims(learned=spread)["alpha_census"]
    assert census.verdict == cl.REPRODUCED
    assert census.ours.startswith("2 heads below 1.25, 2 above 1.75, of 8")
