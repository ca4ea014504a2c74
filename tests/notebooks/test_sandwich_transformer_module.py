"""The Sandwich Transformer notebook's orderings, builders and measures
(``keras_longattn.reproductions.sandwich_transformer``), on tiny sizes, and
the bad inputs the issue names (letters other than s/f, a sandwich k out of
range)."""

import math

import keras
import numpy as np
import pytest

from keras_longattn.models import (build_causal_language_model, build_sublayers,
                                   sandwich_pattern, validate_layer_pattern)
from keras_longattn.reproductions import sandwich_transformer as sw

# The outcome does not depend on the Keras backend (the layers it uses are
# checked on every backend by their own tests): one backend runs it (conftest.py).
pytestmark = pytest.mark.backend_free

# A model trained once, on PyTorch: JAX runs the same code in the planted
# tests (tests/notebooks/test_planted_real.py) and the notebook, on CI time.
trains = pytest.mark.skipif(keras.backend.backend() != "torch",
                            reason="trains a model: run once, on PyTorch")

TINY = sw.LMConfig(length=8, dim=8, num_heads=2, steps=2, batch_size=2,
                   valid_windows=2)


def _tiny(pattern, variant=None, attention="full"):
    keras.utils.set_random_seed(0)
    return sw.build_lm(pattern, vocab_size=16, length=8, dim=8, num_heads=2,
                       attention=sw.attention_spec(attention, 8, ramp=2), variant=variant)


# ------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("pattern", ["sfx", "SF", "s f", "", "ff"])
def test_a_pattern_other_than_s_and_f_is_refused_naming_it(pattern):
    with pytest.raises(ValueError, match=r"layer_pattern.*Received: layer_pattern="):
        validate_layer_pattern(pattern)
    with pytest.raises(ValueError, match="layer_pattern"):
        build_causal_language_model(vocab_size=16, sequence_length=8, dim=8, num_heads=2,
                                    layer_pattern=pattern)
    with pytest.raises(ValueError, match="layer_pattern"):
        build_sublayers(pattern, dim=8, num_heads=2)
    with pytest.raises(ValueError, match="layer_pattern"):
        sw.attention_depth(pattern)


@pytest.mark.parametrize("k, message", [(4, r"k.*<= num_layers=3.*Received: k=4"),
                                        (-1, r"`k` must be >= 0. Received: k=-1"),
                                        (1.5, r"`k` must be an integer. Received: k=1.5"),
                                        (True, r"`k` must be an integer. Received: k=True")])
def test_a_sandwich_k_out_of_range_is_refused_naming_it(k, message):
    with pytest.raises(ValueError, match=message):
        sandwich_pattern(3, k)
    with pytest.raises(ValueError, match="k"):
        sw.arm_patterns(3, [k])


def test_num_layers_out_of_range_is_refused():
    with pytest.raises(ValueError, match="num_layers"):
        sandwich_pattern(0, 0)
    with pytest.raises(ValueError, match="num_layers"):
        sw.random_patterns(0, 1)


# -------------------------------------------------------------- orderings
def test_arm_patterns():
    arms = sw.arm_patterns(4, [1, 3], num_random=3, seed=1)
    assert arms["interleaved"] == "sfsfsfsf"
    assert arms["sandwich_1"] == "ssfsfsff" and arms["sandwich_3"] == "ssssffff"
    randoms = [arms[f"random_{i}"] for i in range(3)]
    assert len(set(arms.values())) == len(arms) == 6
    for p in arms.values():
        assert len(p) == 8 and p.count("s") == 4
    assert sw.arm_patterns(4, [1, 3], num_random=3, seed=1) == arms  # seeded
    assert randoms != [sw.arm_patterns(4, [1, 3], 3, seed=2)[f"random_{i}"] for i in range(3)]
    # k = 0 repeats the interleaved ordering, k = n repeats k = n - 1.
    with pytest.raises(ValueError, match=r"ks.*k=0.*'interleaved'"):
        sw.arm_patterns(3, [0])
    with pytest.raises(ValueError, match=r"ks.*k=3.*'sandwich_2'"):
        sw.arm_patterns(3, [2, 3])


def test_random_patterns_are_distinct_and_counted():
    every = sw.random_patterns(2, 6, seed=0)
    assert sorted(every) == sorted(["ssff", "sfsf", "sffs", "fssf", "fsfs", "ffss"])
    assert sorted(sw.random_patterns(2, 5, exclude={"sfsf"})) == sorted(
        set(every) - {"sfsf"})
    with pytest.raises(ValueError, match=r"count.*at most 5.*count=6"):
        sw.random_patterns(2, 6, exclude={"sfsf"})
    with pytest.raises(ValueError, match="count"):
        sw.random_patterns(2, -1)
    assert sw.random_patterns(3, 0) == []


def test_attention_depth():
    assert sw.attention_depth("ssff") == 1 / 6
    assert sw.attention_depth("ffss") == 5 / 6
    n = 5
    assert math.isclose(sw.attention_depth("sf" * n), (n - 1) / (2 * n - 1))
    assert sw.attention_depth(sandwich_pattern(n, 2)) < sw.attention_depth("sf" * n)
    assert sw.attention_depth("s") == 0.0


def test_spearman():
    assert sw.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert sw.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert sw.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert sw.spearman([1, 1, 2], [3, 3, 1]) == pytest.approx(-1.0)  # ties: average ranks
    assert math.isnan(sw.spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="same length"):
        sw.spearman([1, 2], [1, 2, 3])


# ------------------------------------------------- structure of built models
def test_order_and_parameters_measured_on_built_models():
    interleaved = _tiny("sfsf")
    sandwich = _tiny("ssff")
    other = _tiny("fssf")
    assert sw.sublayer_order(interleaved) == "sfsf"
    assert sw.sublayer_order(sandwich) == "ssff"
    assert sw.sublayer_order(other) == "fssf"
    count = sw.count_parameters(interleaved)
    assert count == sw.count_parameters(sandwich) == sw.count_parameters(other)
    assert sw.structure(sandwich, "ssff") == {"requested": "ssff", "measured": "ssff",
                                              "params": count}
    # One sublayer fewer is a different count: the measure can tell.
    assert sw.count_parameters(_tiny("ssf")) < count


def test_adaptive_span_orderings_have_equal_parameters():
    counts = {p: sw.count_parameters(_tiny(p, attention="adaptive_span"))
              for p in ("sfsf", "ssff")}
    assert len(set(counts.values())) == 1
    assert sw.sublayer_order(_tiny("ssff", attention="adaptive_span")) == "ssff"


def test_planted_builders():
    assert sw.built_pattern("ssff") == "ssff"
    assert sw.built_pattern("ssff", "drops_top_feedforward") == "ssf"
    assert sw.built_pattern("sfsf", "drops_top_feedforward") == "sfsf"
    assert sw.built_pattern("ssff", "ignores_pattern") == "sfsf"
    dropped = _tiny("ssff", "drops_top_feedforward")
    assert sw.sublayer_order(dropped) == "ssf"
    assert sw.count_parameters(dropped) < sw.count_parameters(_tiny("ssff"))
    ignored = _tiny("ssff", "ignores_pattern")
    assert sw.sublayer_order(ignored) == "sfsf"
    assert sw.count_parameters(ignored) == sw.count_parameters(_tiny("ssff"))
    with pytest.raises(ValueError, match="variant"):
        sw.built_pattern("ssff", "nonsense")
    assert {v.name for v in sw.PLANTED.variants} == set(sw.VARIANTS)


def test_attention_spec():
    assert sw.attention_spec("full", 64) == {"class_name": "FullAttention", "config": {}}
    span = sw.attention_spec("adaptive_span", 64, ramp=8)["config"]
    assert span == {"max_span": 64, "ramp": 8, "span_init": 0.5}
    assert sw.attention_spec("local", 64)["config"] == {"window": 16}
    with pytest.raises(ValueError, match="kind"):
        sw.attention_spec("dense", 64)


def test_digits_batches():
    config = sw.DigitsConfig(steps=5, batch_size=4)
    x = np.arange(7)[:, None] * np.ones((1, 64), "int32")
    a, b = config.batches(x, 0), config.batches(x, 0)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (20, 64)
    # Passes over the data: each of the first 7 rows is a different image.
    assert sorted(a[:7, 0].tolist()) == list(range(7))
    assert not np.array_equal(a, config.batches(x, 1))


@trains
def test_a_reused_model_trains_as_a_fresh_one():
    data = sw._lm_data(TINY)
    _, seed0 = sw.train_lm_arm("ssff", 0, TINY, data=data)
    fresh_bits, fresh = sw.train_lm_arm("ssff", 1, TINY, data=data)
    reused_bits, reused = sw.train_lm_arm("ssff", 1, TINY, data=data, reuse=seed0)
    assert reused is seed0
    assert fresh_bits == pytest.approx(reused_bits, rel=1e-5)
    for a, b in zip(fresh.get_weights(), reused.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="reuse"):
        sw.train_lm_arm("sfsf", 1, TINY, data=data, reuse=_tiny("ssf"))


@trains
def test_run_lm_and_run_digits_measure_the_trained_models():
    bits, structures = sw.run_lm({"interleaved": "sfsf", "sandwich_1": "ssff"}, 1, TINY,
                                 verbose=False)
    assert set(bits) == {"interleaved", "sandwich_1"}
    assert all(len(v) == 1 and 0 < v[0] < 10 for v in bits.values())
    assert structures["sandwich_1"]["measured"] == "ssff"
    assert structures["sandwich_1"]["params"] == structures["interleaved"]["params"]
    digits = sw.DigitsConfig(dim=8, steps=2, batch_size=4)
    bits, structures = sw.run_digits({"interleaved": "sf"}, 1, digits, verbose=False)
    assert 0 < bits["interleaved"][0] < math.log2(17) + 1
    assert structures["interleaved"]["measured"] == "sf"
