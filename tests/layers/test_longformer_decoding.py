"""LongformerAttention decoding with a cache (causal): the ring of the
widest dilated window plus the global positions; every schedule of calls
gives the outputs of one causal forward pass (global rows with their own
projections, dilated heads, grouped keys and values, rotary positions),
also compiled with a traced index on JAX and TensorFlow."""

import keras
import numpy as np
import pytest

from keras_longattn.layers import LongformerAttention

from tests.layers.test_decoding import compiled_decoding

B, N, DIM = 2, 23, 16
TOL = 2e-5
BACKEND = keras.backend.backend()


def _inputs(seed=1):
    return np.random.default_rng(seed).normal(size=(B, N, DIM)).astype("float32")


def _layer(**kwargs):
    keras.utils.set_random_seed(0)
    config = dict(num_heads=4, key_dim=8, window=4, dilation=[1, 1, 2, 3], global_tokens=2)
    config.update(kwargs)
    layer = LongformerAttention(**config)
    layer(_inputs(0), _inputs(0), use_causal_mask=True)
    return layer


def _decode(layer, x, chunks):
    cache = layer.init_cache(B, N)
    outs, index = [], 0
    for size in chunks:
        part = x[:, index:index + size]
        out, cache = layer(part, part, use_causal_mask=True, cache=cache,
                           cache_update_index=index)
        assert layer.last_implementation == "decode"
        assert tuple(cache.shape) == tuple(layer.cache_shape(B, N))
        outs.append(keras.ops.convert_to_numpy(out))
        index += size
    return np.concatenate(outs, axis=1)


SCHEDULES = {
    "prefill-then-steps": [6] + [1] * (N - 6),
    "steps-only": [1] * N,
    "one-call": [N],
    "chunks-later": [5, 4, 1, 13],
    "global-positions-in-steps": [1, 1, 3, 18],
}
CASES = [
    ({}, "prefill-then-steps"),
    ({}, "steps-only"),
    ({}, "one-call"),
    ({}, "chunks-later"),
    ({}, "global-positions-in-steps"),
    ({"global_tokens": 0}, "prefill-then-steps"),
    ({"num_key_value_heads": 2}, "prefill-then-steps"),
    ({"rotary_max_wavelength": 100.0}, "chunks-later"),
]


@pytest.mark.every_backend
@pytest.mark.parametrize("config,schedule", CASES,
                         ids=[f"{'-'.join(map(str, c.items())) or 'default'}-{s}"
                              for c, s in CASES])
def test_decoding_gives_the_full_forward_pass(config, schedule):
    layer = _layer(**config)
    x = _inputs()
    expected = keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    got = _decode(layer, x, SCHEDULES[schedule])
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)


def test_the_cache_is_the_ring_and_the_global_slots():
    layer = _layer()
    # ring: max dilation 3 x window 4 + 1 = 13; 2 global positions; their
    # global projections, one row of 4 heads each
    assert layer.cache_shape(B, 32768) == (B, 2, 13 + 2 + 2, 4, 8)
    grouped = _layer(num_key_value_heads=2)
    assert grouped.cache_shape(B, 32768) == (B, 2, 13 + 2 + 4, 2, 8)


def test_global_rows_with_the_ordinary_projections_are_caught():
    """The global rows need the global projections: a step that used the
    ordinary ones would differ at the global positions."""
    layer = _layer()
    x = _inputs()
    expected = keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    original = layer._query_global_dense
    layer._query_global_dense = layer._query_dense
    try:
        got = _decode(layer, x, SCHEDULES["steps-only"])
    finally:
        layer._query_global_dense = original
    assert np.abs(got[:, :2] - expected[:, :2]).max() > 1e-3
    np.testing.assert_allclose(got[:, 2:], expected[:, 2:], atol=TOL, rtol=0)


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="JAX's and TensorFlow's compilers")
def test_compiled_step_with_a_traced_index():
    layer = _layer()
    x = _inputs(2)
    expected = keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    got = compiled_decoding(layer, x, prefill=0)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)


def test_a_global_mask_is_refused_while_decoding():
    layer = _layer()
    x = _inputs()[:, :1]
    with pytest.raises(ValueError, match="global_mask"):
        layer(x, x, use_causal_mask=True, cache=layer.init_cache(B, N), cache_update_index=0,
              global_mask=np.ones((B, 1), bool))
