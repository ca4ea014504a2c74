"""Unit tests of the Synthesizer notebook's functions that moved into
``keras_longattn.reproductions.synthesizer`` (training loops, the LM
places, the planted layers), on every backend, at a tiny size."""

import numpy as np
import pytest

import keras

from keras_longattn.reproductions import synthesizer as syn

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

# A model trained once, on PyTorch: JAX runs the same code in the planted
# tests (tests/notebooks/test_planted_real.py) and the notebooks, on CI time.
trains = pytest.mark.skipif(keras.backend.backend() != "torch",
                            reason="trains a model: run once, on PyTorch")

TINY_RECALL = dict(seeds=1, num_heads=2, pairs=4, num_keys=8, num_values=4, dim=8,
                   batch_size=8, learning_rate=1e-2, steps=2, test_sequences=16)


def test_lm_ranks_share_places_the_seeds_do_not_separate():
    # The shape of the committed full-size run: the three kinds with the dot
    # product differ by less than the margin; factorized_random is far
    # behind but noisy.
    bits = {"dense+vanilla": [3.977, 3.980, 3.984], "vanilla": [3.975, 3.980, 3.990],
            "random+vanilla": [3.995, 4.000, 4.013], "dense": [4.100, 4.103, 4.107],
            "factorized_dense": [4.110, 4.140, 4.159], "random": [4.220, 4.230, 4.240],
            "fixed_random": [4.240, 4.250, 4.265], "factorized_random": [4.78, 4.90, 4.997]}
    ranks = syn.lm_ranks(bits, 0.05)
    assert ranks["dense+vanilla"] == ranks["vanilla"] == ranks["random+vanilla"] == "1–3"
    assert ranks["dense"] == ranks["factorized_dense"] == "4–5"
    assert ranks["random"] == ranks["fixed_random"] == "6–7"
    assert ranks["factorized_random"] == "8"


def test_lm_ranks_order_kinds_separated_by_margin_and_spreads():
    bits = {"a": [1.0, 1.01], "b": [1.2, 1.21], "c": [1.4, 1.41]}
    assert syn.lm_ranks(bits, 0.05) == {"a": "1", "b": "2", "c": "3"}
    # A spread larger than the difference leaves the two unordered.
    bits["b"] = [0.9, 1.5]
    assert syn.lm_ranks(bits, 0.05) == {"a": "1–2", "b": "1–3", "c": "2–3"}


@trains
def test_run_recall_builds_each_kind_with_its_class():
    run = syn.run_recall(["vanilla", "random+vanilla"],
                         classes={"random+vanilla": syn.MixtureWithoutVanilla},
                         verbose=False, **TINY_RECALL)
    assert set(run["accuracy"]) == {"vanilla", "random+vanilla"}
    assert all(len(v) == 1 and 0.0 <= v[0] <= 1.0 for v in run["accuracy"].values())
    assert run["mixture"]["vanilla"] == [None]
    # The broken mixture gives its vanilla component weight 0.
    np.testing.assert_allclose(run["mixture"]["random+vanilla"][0], [1.0, 0.0])
    assert run["chance"] == 0.25
    trainable, unread = run["params"]["random+vanilla"]
    assert trainable > 0 and unread == 0


@trains
def test_run_recall_seeds_restart_the_same_model():
    run = syn.run_recall(["dense"], verbose=False, **dict(TINY_RECALL, seeds=2))
    assert len(run["accuracy"]["dense"]) == 2
    again = syn.run_recall(["dense"], verbose=False, **dict(TINY_RECALL, seeds=2))
    assert again["accuracy"] == run["accuracy"]


@trains
def test_run_lm_tiny():
    run = syn.run_lm(["random+vanilla"], seeds=1, num_heads=2, length=8, dim=8, layers=1,
                     batch_size=4, learning_rate=3e-3, steps=2, valid_windows=2,
                     verbose=False)
    (bits,) = run["bits"]["random+vanilla"]
    assert 0.0 < bits < 9.0 and 0.0 < run["unigram_bits"] < 8.0
    assert len(run["mixture"]["random+vanilla"][0]) == 2


def test_planted_layers_are_broken_as_named():
    probes = {cls.__name__: syn.probe_kinds([kind], num_heads=2, length=6, dim=8,
                                            classes={kind: cls})[kind]
              for kind, cls in (("dense", syn.WithDotProduct),
                                ("vanilla", syn.DenseAsVanilla),
                                ("vanilla", syn.FixedRandomAsVanilla))}
    # A dense layer given the dot product reads the other tokens.
    assert probes["WithDotProduct"]["other_token"] > 1e-3
    # "vanilla" built as dense reads its own token only; as fixed_random, nothing.
    assert probes["DenseAsVanilla"]["other_token"] == 0.0
    assert probes["FixedRandomAsVanilla"]["input_dependence"] == 0.0
    changes = syn.training_changes(["random"], num_heads=2, length=6, dim=8, steps=2,
                                   classes={"random": syn.FrozenRandomTable})
    assert changes["random"]["synthesizer/random_logits"] == 0.0


def test_recall_planted_layers_compare_the_query_with_other_tokens():
    # The per-kind recall variants: a kind without the dot product that gets
    # a query-key comparison after all reads the other tokens (the real
    # kinds read none, test_planted_bugs_synthesizer.py), and a mixture
    # without its vanilla component does not.
    for kind, cls in (("random", syn.DotProductComponent),
                      ("factorized_random", syn.DotProductComponent),
                      ("dense+random", syn.DotProductComponent),
                      ("fixed_random", syn.WithDotProduct),
                      ("factorized_dense", syn.CrossedFactors)):
        probe = syn.probe_kinds([kind], num_heads=2, length=6, dim=8,
                                classes={kind: cls})[kind]
        assert probe["other_token"] > 1e-3 and probe["future_leak"] == 0.0, (kind, probe)
    probe = syn.probe_kinds(["dense+vanilla"], num_heads=2, length=6, dim=8,
                            classes={"dense+vanilla": syn.MixtureWithoutVanilla})
    assert probe["dense+vanilla"]["other_token"] == 0.0


def test_every_planted_variant_has_an_arm():
    names = {v.name for v in syn.PLANTED.variants}
    assert names == set(syn._PLANTED_ARMS)
    for stage, kind, cls in syn._PLANTED_ARMS.values():
        assert stage in ("probe", "train", "recall") and kind in syn.KINDS
        assert issubclass(cls, syn.SynthesizerAttention)


@pytest.mark.parametrize("name", ["input_free_weights", "dense_reads_own_token",
                                  "causal_no_leak", "fixed_random_not_trained",
                                  "mixture_learned", "recall_vanilla_solves",
                                  "recall_synthetic_near_chance",
                                  "recall_vanilla_beats_dense",
                                  "recall_random+vanilla_as_vanilla",
                                  "recall_vanilla_beats_random",
                                  "recall_vanilla_beats_fixed_random",
                                  "recall_vanilla_beats_factorized_dense",
                                  "recall_vanilla_beats_factorized_random",
                                  "recall_vanilla_beats_dense+random",
                                  "recall_dense+vanilla_as_vanilla"])
def test_every_asserted_claim_of_the_small_run_is_targeted(name):
    targeted = {c for v in syn.PLANTED.variants for c in v.claims}
    assert name in targeted
