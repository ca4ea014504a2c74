"""AdaptiveSpanAttention: the conformance suite, and what is specific to
learned spans: the soft mask's definition, spans at the maximum with a ramp
of 1 equal LocalAttention (and FullAttention), the ramp passes a gradient
to the spans, the span penalty in training only, a band that follows the
spans, decoding with a ring, bad arguments."""

import keras
import numpy as np
import pytest

from keras_longattn.layers import AdaptiveSpanAttention
from keras_longattn.layers import FullAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import input_gradient
from keras_longattn.testing import rel_error
from keras_longattn.testing.properties import AttentionLayerProperties

B, N, DIM, H, D = 2, 29, 16, 2, 8


def _np(x):
    return keras.ops.convert_to_numpy(x)


def _x(seed=0, n=N, batch=B):
    return np.random.default_rng(seed).standard_normal((batch, n, DIM)).astype("float32")


class TestAdaptiveSpanAttention(AttentionLayerConformance):
    layer_cls = AdaptiveSpanAttention
    # Span 4 and ramp 4: a reach of 7 < the static 11, so the band differs
    # from the reference's pattern.
    init_kwargs = {"num_heads": 2, "key_dim": 8, "max_span": 8, "ramp": 4,
                   "span_init": 0.5}
    implementation = "blocked"
    reference_lengths = (5, 37, 2048)


class TestAdaptiveSpanAttentionLongSpans(AttentionLayerConformance):
    """Spans longer than some sequences, an odd block size, a penalty."""

    layer_cls = AdaptiveSpanAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "max_span": 30, "ramp": 3,
                   "span_init": 0.7, "span_penalty": 1e-3, "block_size": 5}
    reference_lengths = (3, 23, 64)
    secondary = True


def _set_fractions(layer, fractions):
    layer._spans.fractions.assign(np.asarray(fractions, "float32"))


def test_soft_mask_is_the_papers():
    layer = AdaptiveSpanAttention(num_heads=3, key_dim=4, max_span=20, ramp=4)
    layer(_x(n=4), _x(n=4))
    _set_fractions(layer, [0.0, 0.5, 0.13])
    z = np.array([0.0, 10.0, 2.6])
    np.testing.assert_allclose(_np(layer.current_spans()), z, rtol=1e-6)
    x = np.arange(30)
    expected = np.clip((4 + z[:, None] - x[None]) / 4, 0, 1)
    np.testing.assert_allclose(_np(layer.span_mask(x)), expected, atol=1e-6)
    # Keys at x >= max z + R weigh nothing: the reach is ceil(10 + 4) - 1.
    assert layer.current_reach() == 13
    assert layer.static_reach == 23


@pytest.mark.parametrize("causal", [True, False])
def test_spans_at_the_maximum_with_a_unit_ramp_equal_local_attention(causal):
    span = 6
    x = _x(1)
    mask = np.ones((B, N), bool)
    mask[0, -5:] = False
    local = LocalAttention(num_heads=H, key_dim=D, window=2 * span + 1, look_back=span,
                           look_ahead=span)
    local(x, x)
    layer = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=span, ramp=1,
                                  span_init=1.0)
    layer(x, x)
    layer.set_weights(local.get_weights())
    for kwargs in ({}, {"value_mask": mask, "query_mask": mask}):
        ours = _np(layer(x, x, use_causal_mask=causal, **kwargs))
        assert layer.last_implementation == "blocked"
        theirs = _np(local(x, x, use_causal_mask=causal, **kwargs))
        assert rel_error(ours, theirs) < 1e-5


@pytest.mark.parametrize("causal", [True, False])
def test_spans_beyond_the_sequence_equal_full_attention(causal):
    x = _x(2)
    full = FullAttention(num_heads=H, key_dim=D)
    full(x, x)
    layer = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=N, ramp=8,
                                  span_init=1.0)
    layer(x, x)
    layer.set_weights(full.get_weights())
    _, w_ours = layer(x, x, use_causal_mask=causal, return_attention_scores=True)
    theirs, w_theirs = full(x, x, use_causal_mask=causal, return_attention_scores=True)
    ours = layer(x, x, use_causal_mask=causal)
    assert layer.last_implementation == "blocked"
    assert rel_error(_np(ours), _np(theirs)) < 1e-5
    np.testing.assert_allclose(_np(w_ours), _np(w_theirs), atol=1e-6)


def test_weights_are_the_renormalised_masked_softmax():
    """Weights ``p m / Σ p m``, exact zeros from ``z + R`` on."""
    x = _x(3)
    layer = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=16, ramp=4)
    layer(x, x)
    _set_fractions(layer, [0.25, 0.6])  # z = 4, 9.6
    _, w = layer(x, x, use_causal_mask=True, return_attention_scores=True)
    w = _np(w)
    full = FullAttention(num_heads=H, key_dim=D)
    full(x, x)
    full.set_weights(layer.get_weights()[:-1])
    _, p = full(x, x, use_causal_mask=True, return_attention_scores=True)
    p = _np(p).astype("float64")
    distance = np.arange(N)[:, None] - np.arange(N)[None]
    m = np.clip((4 + np.array([4.0, 9.6])[:, None, None] - distance[None]) / 4, 0, 1)
    m = m * (distance >= 0)
    expected = p * m[None] / (p * m[None]).sum(-1, keepdims=True)
    np.testing.assert_allclose(w, expected, atol=2e-6)
    assert np.all(w[:, 0][:, distance >= 8] == 0.0)  # z + R = 8
    assert np.all(w[:, 1][:, distance >= 14] == 0.0)  # ceil(13.6)
    assert np.all(w[:, 1][:, (distance >= 0) & (distance < 13)] > 0.0)
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)


def _fraction_function(layer, x, causal=True):
    """``f(fractions)``: the layer's output with the span fractions given as
    a tensor (through ``stateless_call``), weighted so that it sums to
    something that depends on every weight."""
    trainable = list(layer.trainable_variables)
    position = [v.path for v in trainable].index(layer._spans.fractions.path)
    non_trainable = list(layer.non_trainable_variables)

    def f(fractions):
        values = list(trainable)
        values[position] = fractions
        out, _ = layer.stateless_call(values, non_trainable, x, x, use_causal_mask=causal)
        weights = np.linspace(-1.0, 1.0, np.prod(out.shape)).reshape(out.shape)
        return out * keras.ops.convert_to_tensor(weights.astype("float32"))

    return f


@pytest.mark.parametrize("causal", [True, False])
def test_the_ramp_passes_a_gradient_to_the_spans(causal):
    x = _x(4)
    layer = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=20, ramp=6)
    layer(x, x)
    fractions = np.array([0.137, 0.351], "float32")  # z = 2.74, 7.02: keys on the ramp
    f = _fraction_function(layer, x, causal)
    grad = input_gradient(f, fractions)
    assert np.all(np.isfinite(grad)) and np.all(grad != 0.0)

    def total(v):
        return float(np.sum(_np(f(keras.ops.convert_to_tensor(v)))))

    step = 1e-3  # z moves by 0.02: no key crosses a kink of the mask
    fd = np.array([(total(fractions + step * e) - total(fractions - step * e)) / (2 * step)
                   for e in np.eye(H, dtype="float32")])
    np.testing.assert_allclose(grad, fd, rtol=2e-2, atol=1e-3)


def test_no_gradient_where_every_mask_is_one():
    """Spans beyond the sequence: the mask is clamped at 1 on every key, and
    the spans get no gradient (the ramp is where they learn)."""
    x = _x(5, n=10)
    layer = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=40, ramp=4)
    layer(x, x)
    grad = input_gradient(_fraction_function(layer, x), np.array([0.5, 0.9], "float32"))
    np.testing.assert_array_equal(grad, 0.0)


def test_span_penalty_is_added_in_training_only():
    x = _x(6)
    layer = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=16, ramp=4,
                                  span_penalty=0.01)
    layer(x, x)
    _set_fractions(layer, [0.25, 0.75])  # z = 4, 12: mean 8
    layer(x, x, training=False)
    assert len(layer.losses) == 0
    layer(x, x, training=True)
    assert len(layer.losses) == 1
    np.testing.assert_allclose(float(_np(layer.losses[0])), 0.01 * 8.0, rtol=1e-6)
    layer(x, x, training=False)
    assert len(layer.losses) == 0
    quiet = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=16, ramp=4)
    quiet(x, x, training=True)
    assert len(quiet.losses) == 0


def test_span_penalty_shrinks_the_spans_in_fit():
    """With a target the attention cannot help with, the penalty alone
    moves the spans: they shrink."""
    x = _x(7, batch=4)
    inp = keras.Input((N, DIM))
    attention = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=16, ramp=4,
                                      span_init=0.5, span_penalty=10.0)
    model = keras.Model(inp, attention(inp, inp, use_causal_mask=True))
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    before = _np(attention.current_spans())
    model.fit(x, np.zeros_like(x), epochs=3, batch_size=2, verbose=0)
    after = _np(attention.current_spans())
    assert np.all(after < before)
    assert np.all(after >= 0.0)


def test_band_follows_the_current_spans(monkeypatch):
    x = _x(8, n=64, batch=1)
    layer = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=32, ramp=4)
    layer(x, x)
    reaches = []
    original = AdaptiveSpanAttention._band

    def spy(self, query, key, value, look_back, look_ahead, *args):
        reaches.append((look_back, look_ahead))
        return original(self, query, key, value, look_back, look_ahead, *args)

    monkeypatch.setattr(AdaptiveSpanAttention, "_band", spy)
    for fractions, reach in (([1.0, 0.0], 35), ([0.25, 0.1], 11), ([0.0, 0.0], 3)):
        _set_fractions(layer, fractions)
        layer(x, x, use_causal_mask=True)
        layer(x, x)
        assert reaches[-2:] == [(reach, 0), (reach, reach)]


@pytest.mark.parametrize("chunks", [[5] + [1] * 24, [3, 2, 4, 1, 3, 9, 7], [29]])
def test_decoding_gives_the_full_forward_pass(chunks):
    keras.utils.set_random_seed(0)
    layer = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=8, ramp=3)
    x = _x(9)
    layer(x, x)
    _set_fractions(layer, [0.3, 1.0])
    expected = _np(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(B, N)
    assert tuple(cache.shape) == (B, 2, 10, H, D)  # a ring of max_span + ramp - 1
    outs, index = [], 0
    for size in chunks:
        part = x[:, index:index + size]
        out, cache = layer(part, part, use_causal_mask=True, cache=cache,
                           cache_update_index=index)
        assert layer.last_implementation == "decode"
        outs.append(_np(out))
        index += size
    np.testing.assert_allclose(np.concatenate(outs, axis=1), expected, atol=2e-5)


def test_causality_by_perturbation_with_long_spans():
    x = _x(10, n=40)
    layer = AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=64, ramp=8,
                                  span_init=0.9)
    y = _np(layer(x, x, use_causal_mask=True))
    for t in (0, 17, 38):
        x2 = x.copy()
        x2[:, t + 1:] = 10.0 * np.random.default_rng(t).standard_normal(x2[:, t + 1:].shape)
        y2 = _np(layer(x2, x2, use_causal_mask=True))
        np.testing.assert_allclose(y2[:, :t + 1], y[:, :t + 1], rtol=1e-6, atol=1e-6)
        assert not np.allclose(y2[:, t + 1:], y[:, t + 1:])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_span": 0}, "max_span=0"),
        ({"max_span": 2.5}, "max_span=2.5"),
        ({"ramp": 0}, "ramp=0"),
        ({"ramp": -3}, "ramp=-3"),
        ({"span_init": 1.5}, "span_init=1.5"),
        ({"span_init": -0.1}, "span_init=-0.1"),
        ({"span_penalty": -1.0}, "span_penalty=-1.0"),
        ({"span_penalty": float("inf")}, "span_penalty=inf"),
        ({"block_size": 0}, "block_size=0"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    args = {"num_heads": H, "key_dim": D, "max_span": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        AdaptiveSpanAttention(**args)


def test_spans_of_an_unbuilt_layer_are_refused():
    with pytest.raises(ValueError, match="built"):
        AdaptiveSpanAttention(num_heads=H, key_dim=D, max_span=8).current_spans()


class TestAdaptiveSpanAttentionProperties(AttentionLayerProperties):
    """The property checks of the contract (random lengths, padding,
    dtypes, batch composition, non-finite padding) with spans of 3 and 6
    and a ramp of 2."""

    layer_cls = AdaptiveSpanAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "max_span": 12, "ramp": 2,
                   "span_init": 0.25}
    ci_properties = ("test_prop_matches_reference", "test_prop_nonfinite_padding",
                     "test_prop_batch_composition", "test_prop_dynamic_length")
    invalid_arguments = {"max_span": (0, 1.5), "ramp": (0, -1), "span_init": (1.5, -0.5),
                         "span_penalty": (-1.0,), "block_size": (0,)}
