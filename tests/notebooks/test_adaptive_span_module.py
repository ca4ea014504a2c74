"""The Adaptive Attention Span notebook's training and measuring functions
(``keras_longattn.reproductions.adaptive_span``) and its planted layers, on
tiny sizes."""

import dataclasses

import keras
import numpy as np
import pytest

from keras_longattn.layers import AdaptiveSpanAttention, LocalAttention
from keras_longattn.models import build_causal_language_model
from keras_longattn.reproductions import adaptive_span as asp
from keras_longattn.testing import input_gradient

# A model trained once, on PyTorch: JAX runs the same code in the planted
# tests (tests/notebooks/test_planted_real.py) and the notebook, on CI time.
trains = pytest.mark.skipif(keras.backend.backend() != "torch",
                            reason="trains a model: run once, on PyTorch")
jax_only = pytest.mark.skipif(keras.backend.backend() != "jax",
                              reason="reads XLA's analysis of a compiled JAX program")

TINY = asp.LMConfig(length=16, layers=2, dim=8, num_heads=2, max_span=8, ramp=2,
                    span_init=1.0, span_penalty=1e-3, batch_size=2, steps=2,
                    valid_windows=2, learning_rate=1e-2)


def _x(seed=0, n=12, dim=8):
    return np.random.default_rng(seed).standard_normal((1, n, dim)).astype("float32")


def _fraction_gradient(layer, x):
    """The gradient of a weighted sum of the layer's causal output with
    respect to its span fractions (through ``stateless_call``)."""
    trainable = list(layer.trainable_variables)
    non_trainable = list(layer.non_trainable_variables)
    position = [v.path for v in trainable].index(layer._spans.fractions.path)

    def f(fractions):
        values = list(trainable)
        values[position] = fractions
        out, _ = layer.stateless_call(values, non_trainable, x, x, use_causal_mask=True)
        weights = np.linspace(-1.0, 1.0, int(np.prod(out.shape))).reshape(out.shape)
        # The zero term keeps the fractions connected to the result, so that
        # a gradient that does not reach them reads 0 on every backend.
        return (out * keras.ops.convert_to_tensor(weights.astype("float32"))
                + 0.0 * keras.ops.sum(fractions))

    return input_gradient(f, np.array([0.2, 0.45], "float32"))


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="steps"):
        asp.LMConfig(steps=0)
    with pytest.raises(ValueError, match="num_heads"):
        asp.LMConfig(dim=30, num_heads=4)
    with pytest.raises(ValueError, match="max_span"):
        asp.LMConfig(length=32, max_span=32)


def test_attention_of_the_arms_and_variants():
    fixed = asp.lm_attention("fixed", TINY)
    assert type(fixed) is LocalAttention and fixed.window == TINY.max_span
    adaptive = asp.lm_attention("adaptive", TINY)
    assert type(adaptive) is AdaptiveSpanAttention
    assert (adaptive.max_span, adaptive.ramp, adaptive.span_init, adaptive.span_penalty) == (
        8, 2, 1.0, 1e-3)
    assert isinstance(asp.lm_attention("adaptive", TINY, "frozen_at_max"),
                      asp.FrozenSpanAttention)
    assert isinstance(asp.lm_attention("adaptive", TINY, "stopped_ramp"),
                      asp.StoppedRampAttention)
    with pytest.raises(ValueError, match="arm"):
        asp.lm_attention("full", TINY)
    with pytest.raises(ValueError, match="variant"):
        asp.lm_attention("adaptive", TINY, "nonsense")


def test_frozen_spans_stay_at_the_maximum_without_penalty():
    layer = asp.FrozenSpanAttention(num_heads=2, key_dim=4, max_span=8, ramp=2,
                                    span_init=0.0, span_penalty=0.5)
    x = _x()
    layer(x, x, use_causal_mask=True, training=True)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(layer.current_spans()), [8.0, 8.0])
    assert layer._spans.fractions.path not in [v.path for v in layer.trainable_variables]
    assert layer.span_penalty == 0.0 and not layer.losses


def test_stopped_ramp_has_the_same_outputs_and_no_span_gradient():
    x = _x(1)
    keras.utils.set_random_seed(0)
    real = AdaptiveSpanAttention(num_heads=2, key_dim=4, max_span=10, ramp=4)
    stopped = asp.StoppedRampAttention(num_heads=2, key_dim=4, max_span=10, ramp=4)
    real(x, x)
    stopped(x, x)
    stopped.set_weights(real.get_weights())
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(stopped(x, x, use_causal_mask=True)),
        keras.ops.convert_to_numpy(real(x, x, use_causal_mask=True)), atol=1e-6)
    assert np.all(_fraction_gradient(real, x) != 0.0)
    np.testing.assert_array_equal(_fraction_gradient(stopped, x), 0.0)


def test_learned_spans_of_a_model():
    keras.utils.set_random_seed(0)
    model = build_causal_language_model(
        vocab_size=256, sequence_length=TINY.length, dim=TINY.dim, num_layers=TINY.layers,
        num_heads=TINY.num_heads,
        attention=asp.lm_attention("adaptive", dataclasses.replace(TINY, span_init=0.5)))
    assert len(asp.span_attention_layers(model)) == 2
    np.testing.assert_allclose(asp.learned_spans(model), np.full((2, 2), 4.0))
    local = build_causal_language_model(vocab_size=256, sequence_length=16, dim=8,
                                        num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="AdaptiveSpanAttention"):
        asp.learned_spans(local)


@jax_only
def test_span_cost_follows_the_spans():
    keras.utils.set_random_seed(0)
    layer = AdaptiveSpanAttention(num_heads=2, key_dim=8, max_span=48, ramp=4,
                                  span_init=0.125)
    inputs = keras.Input((64, 16))
    model = keras.Model(inputs, layer(inputs, inputs, use_causal_mask=True))
    cost = asp.span_cost(model, 256)
    assert cost["learned"]["reach"] == 9 and cost["max"]["reach"] == 51
    assert cost["max"]["gflops"] > 1.5 * cost["learned"]["gflops"]
    assert cost["max"]["temp_mib"] > cost["learned"]["temp_mib"]
    # The layer's own reach is back once the programs are built.
    assert layer.current_reach() == 9 and "current_reach" not in vars(layer)
    layer._spans.fractions.assign(np.ones(2, "float32"))
    at_max = asp.span_cost(model, 256)
    assert at_max["learned"]["gflops"] == pytest.approx(at_max["max"]["gflops"])


def test_span_cost_is_jax_only():
    if keras.backend.backend() == "jax":
        with pytest.raises(ValueError, match="AdaptiveSpanAttention"):
            asp.span_cost(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), 8)
    else:
        with pytest.raises(ValueError, match="JAX"):
            asp.span_cost(None, 8)


@trains
def test_run_lm_trains_both_arms_and_moves_the_spans():
    bits, spans, costs = asp.run_lm(TINY, 2, verbose=False)
    assert set(bits) == {"adaptive", "fixed"} and all(len(v) == 2 for v in bits.values())
    assert all(2.0 < b < 9.0 for v in bits.values() for b in v)
    assert len(spans) == 2 and spans[0].shape == (2, 2) and costs == []
    # The penalty and the data moved the spans below the maximum.
    assert np.all(spans[0] < TINY.max_span)
