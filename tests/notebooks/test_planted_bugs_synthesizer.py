"""Unit tests of the Synthesizer notebook's claim checks
(``reproductions.synthesizer.synthesizer_claims``) on every backend.

The mechanism claims read probes of tiny real layers (what the weights and
outputs depend on; what a few optimizer steps move), some of them broken;
the recall and text claims read typed-in per-seed numbers shaped like the
notebook's outputs, which test the check functions only. The planted bugs
that count are the notebook's ``PLANTED`` set: broken layers trained
through the notebook's own functions (``tests/notebooks/test_planted_real.py``).
"""

import functools

import keras
import pytest

from keras_longattn.layers import SynthesizerAttention
from keras_longattn.reproductions import claims as cl
from keras_longattn.reproductions import synthesizer as syn

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

LENGTH, DIM, HEADS = 8, 8, 2
KINDS = ("vanilla",) + syn.PURE_SYNTHETIC + syn.MIXTURES
MARGINS = dict(zero_tolerance=1e-6, detect=1e-3, min_vanilla_accuracy=0.8,
               max_synthetic_excess=0.1, recall_margin=0.3, assert_recall_mixtures=True,
               lm_margin=0.05, train_steps=2)
CHANCE = 1 / 8


# The broken layers are those of the notebook's real planted set
# (``reproductions.synthesizer.PLANTED``, run by test_planted_real.py).
ReadsKeys = syn.ReadsKeys
LeakyCausal = syn.LeakyCausal
FrozenMixture = syn.FrozenMixture
TrainedFixedRandom = syn.TrainedFixedRandom


def _layer(kind, cls=SynthesizerAttention):
    keras.utils.set_random_seed(0)
    return cls(num_heads=HEADS, key_dim=DIM // HEADS, kind=kind, max_length=LENGTH)


@functools.lru_cache(maxsize=None)
def _probe(kind, cls=SynthesizerAttention):
    return syn.probe_layer(_layer(kind, cls), LENGTH, DIM)


@functools.lru_cache(maxsize=None)
def _change(kind, cls=SynthesizerAttention):
    return syn.training_change(_layer(kind, cls), LENGTH, DIM, steps=2)


def _probes(**swap):
    """The probes of every kind, some measured on a broken class."""
    return {k: _probe(k, swap.get(k, SynthesizerAttention)) for k in KINDS}


def _changes(**swap):
    return {k: _change(k, swap.get(k, SynthesizerAttention))
            for k in ("fixed_random", "random", "random+vanilla")}


def _recall(**arms):
    acc = {"vanilla": [0.97, 0.99], "dense": [0.13, 0.15], "random": [0.12, 0.14],
           "random+vanilla": [0.95, 0.98], "dense+vanilla": [0.96, 0.99]}
    acc.update(arms)
    return acc


def _results(probes=None, changes=None, recall=None, lm=None):
    return {"probes": _probes() if probes is None else probes,
            "training_change": _changes() if changes is None else changes,
            "recall_accuracy": _recall() if recall is None else recall,
            "chance": CHANCE,
            "lm_bits": lm or {}}


def _failed(claims):
    return {c.name for c in claims if c.failed}


# ------------------------------------------------------------- real layers


def test_probes_of_the_real_layer():
    probes = _probes()
    for k in syn.INPUT_FREE:
        assert probes[k]["input_dependence"] <= 1e-6, k
    for k in syn.OWN_TOKEN:
        assert probes[k]["other_token"] <= 1e-6 < 1e-3 <= probes[k]["own_token"], k
    for k in KINDS:
        assert probes[k]["future_leak"] <= 1e-6, k
        assert probes[k]["future_leak_unmasked"] >= 1e-3, k
    assert probes["vanilla"]["other_token"] >= 1e-3
    changes = _changes()
    assert changes["fixed_random"]["synthesizer/fixed_random_logits"] == 0.0
    assert changes["fixed_random"]["attention_weights"] == 0.0
    assert changes["random"]["synthesizer/random_logits"] > 1e-3
    assert changes["random"]["attention_weights"] > 1e-3
    # The projections a kind never reads are frozen, so nothing warns.
    assert changes["random"]["query/kernel"] == 0.0
    assert changes["random+vanilla"]["synthesizer/mixture_logits"] > 1e-3


def test_real_layers_pass():
    claims = syn.synthesizer_claims(_results(), MARGINS)
    names = {c.name for c in claims}
    assert {"input_free_weights", "dense_reads_own_token", "causal_no_leak",
            "fixed_random_not_trained", "mixture_learned", "recall_vanilla_solves",
            "recall_synthetic_near_chance", "recall_vanilla_beats_dense",
            "recall_random+vanilla_as_vanilla"} <= names
    assert not _failed(claims)
    cl.assert_claims(claims)


# ------------------------------------------------------------ planted bugs


def test_planted_fixed_random_reads_the_input_fails():
    probes = _probes(fixed_random=ReadsKeys)
    assert probes["fixed_random"]["input_dependence"] > 1e-3
    claims = syn.synthesizer_claims(_results(probes=probes), MARGINS)
    assert _failed(claims) == {"input_free_weights"}
    with pytest.raises(cl.ClaimFailure):
        cl.assert_claims(claims)


def test_planted_dense_reads_other_tokens_fails():
    probes = _probes(dense=ReadsKeys)
    assert probes["dense"]["other_token"] > 1e-3
    claims = syn.synthesizer_claims(_results(probes=probes), MARGINS)
    assert _failed(claims) == {"dense_reads_own_token"}


@pytest.mark.parametrize("kind", ["fixed_random", "dense", "random+vanilla"])
def test_planted_causal_leak_fails(kind):
    probes = _probes(**{kind: LeakyCausal})
    assert probes[kind]["future_leak"] > 1e-3
    claims = syn.synthesizer_claims(_results(probes=probes), MARGINS)
    assert _failed(claims) == {"causal_no_leak"}


def test_planted_blind_control_fails():
    # Bug in the measurement: the control is a layer that cannot show the
    # effect (vanilla swapped for fixed_random), so a "no dependence" result
    # would prove nothing.
    probes = _probes()
    probes["vanilla"] = probes["fixed_random"]
    failed = _failed(syn.synthesizer_claims(_results(probes=probes), MARGINS))
    assert {"input_free_weights", "dense_reads_own_token"} <= failed


def test_planted_frozen_mixture_fails():
    changes = _changes(**{"random+vanilla": FrozenMixture})
    assert changes["random+vanilla"]["synthesizer/mixture_logits"] == 0.0
    claims = syn.synthesizer_claims(_results(changes=changes), MARGINS)
    assert _failed(claims) == {"mixture_learned"}


def test_planted_trained_fixed_random_fails():
    changes = _changes(fixed_random=TrainedFixedRandom)
    assert changes["fixed_random"]["attention_weights"] > 1e-3
    claims = syn.synthesizer_claims(_results(changes=changes), MARGINS)
    assert _failed(claims) == {"fixed_random_not_trained"}


def test_planted_vanilla_without_content_fails_on_recall():
    # Bug: the "vanilla" arm cannot compare query and key (e.g. the dot
    # product dropped): it scores like the synthetic kinds.
    claims = syn.synthesizer_claims(_results(recall=_recall(vanilla=[0.13, 0.14])), MARGINS)
    assert {"recall_vanilla_solves", "recall_vanilla_beats_dense",
            "recall_vanilla_beats_random"} <= _failed(claims)


def test_planted_position_leak_in_the_task_fails():
    # Bug: the stored pair sits at a fixed position, which a random table
    # can learn to read: the synthetic kinds solve the task.
    claims = syn.synthesizer_claims(_results(recall=_recall(random=[0.9, 0.95])), MARGINS)
    assert {"recall_synthetic_near_chance", "recall_vanilla_beats_random"} <= _failed(claims)


def test_planted_mixture_without_its_dot_product_fails_on_recall():
    # Bug: the mixture drops its vanilla component: it scores like random.
    claims = syn.synthesizer_claims(
        _results(recall=_recall(**{"random+vanilla": [0.12, 0.15]})), MARGINS)
    assert _failed(claims) == {"recall_random+vanilla_as_vanilla"}


def test_noisy_seeds_are_not_testable_and_fail_when_asserted():
    claims = syn.synthesizer_claims(_results(recall=_recall(dense=[0.1, 0.6])), MARGINS)
    by_name = {c.name: c for c in claims}
    assert by_name["recall_vanilla_beats_dense"].verdict == "not testable at this scale"
    assert "recall_vanilla_beats_dense" in _failed(claims)


def test_text_claims_are_reported_with_verdicts():
    lm = {"vanilla": [2.50, 2.52], "dense": [2.70, 2.72], "random": [2.60, 2.61],
          "fixed_random": [3.10, 3.12], "dense+vanilla": [2.49, 2.51],
          "random+vanilla": [2.55, 2.56]}
    claims = {c.name: c for c in syn.synthesizer_claims(_results(lm=lm), MARGINS)}
    assert claims["lm_fixed_random_worst"].verdict == "reproduced"
    assert "dense" in claims["lm_fixed_random_worst"].statement
    assert claims["lm_dense+vanilla_vs_vanilla"].verdict == "reproduced"
    assert claims["lm_vanilla_beats_dense"].verdict == "reproduced"
    # Fixed random not the worst: not reproduced, but never asserted.
    lm["fixed_random"] = [2.40, 2.41]
    claims = {c.name: c for c in syn.synthesizer_claims(_results(lm=lm), MARGINS)}
    assert claims["lm_fixed_random_worst"].verdict == "not reproduced"
    assert not any(c.asserted for n, c in claims.items() if n.startswith("lm_"))
    # Seeds that do not separate: not testable.
    lm["fixed_random"] = [2.5, 3.2]
    claims = {c.name: c for c in syn.synthesizer_claims(_results(lm=lm), MARGINS)}
    assert claims["lm_fixed_random_worst"].verdict == "not testable at this scale"
