"""RoutingAttention decoding with a cache (causal token routing): a prompt
prefilled in one call and the rest decoded token by token (or several
tokens at a time later on) gives the outputs of one causal forward pass
over the whole sequence, with routing and local heads, grouped keys and
values, rotary positions; the centroids stay where they are; compiled
steps with a traced index on JAX and TensorFlow."""

import keras
import numpy as np
import pytest

from keras_longattn.layers import RoutingAttention

from tests.layers.test_decoding import compiled_decoding

B, N, DIM = 2, 23, 16
TOL = 2e-5
BACKEND = keras.backend.backend()


def _inputs(seed=0):
    return np.random.default_rng(seed).normal(size=(B, N, DIM)).astype("float32")


def _layer(**kwargs):
    keras.utils.set_random_seed(0)
    config = dict(num_heads=3, key_dim=8, num_clusters=3, window=4, local_heads=1)
    config.update(kwargs)
    layer = RoutingAttention(**config)
    x = _inputs()
    layer(x, x, use_causal_mask=True)
    # Spread the centroids so that every cluster takes tokens.
    rng = np.random.default_rng(5)
    layer.centroids.assign(rng.normal(size=tuple(layer.centroids.shape)).astype("float32"))
    return layer


def _decode(layer, x, chunks):
    cache = layer.init_cache(B, N)
    outs, index = [], 0
    for size in chunks:
        part = x[:, index:index + size]
        out, cache = layer(part, part, use_causal_mask=True, cache=cache,
                           cache_update_index=index)
        assert layer.last_implementation == "decode"
        outs.append(keras.ops.convert_to_numpy(out))
        index += size
    return np.concatenate(outs, axis=1)


SCHEDULES = {
    "prefill-then-steps": [6] + [1] * (N - 6),
    "steps-only": [1] * N,
    "one-call": [N],
    "chunks-later": [5, 1, 4, 3, 1, 9],
}
CASES = [
    ({}, "prefill-then-steps"),
    ({}, "steps-only"),
    ({}, "one-call"),
    ({}, "chunks-later"),
    ({"local_heads": 0}, "prefill-then-steps"),
    ({"num_heads": 4, "num_key_value_heads": 2, "local_heads": 1}, "prefill-then-steps"),
    ({"rotary_max_wavelength": 100.0}, "chunks-later"),
]


@pytest.mark.every_backend
@pytest.mark.parametrize("config,schedule", CASES,
                         ids=[f"{'-'.join(map(str, c.items())) or 'default'}-{s}"
                              for c, s in CASES])
def test_decoding_gives_the_full_forward_pass(config, schedule):
    layer = _layer(**config)
    x = _inputs(1)
    expected = keras.ops.convert_to_numpy(
        layer(x, x, use_causal_mask=True, training=False))
    clusters = layer.compute_clusters(x, use_causal_mask=True)
    # The test covers clusters with several chunks (the window is 4).
    if layer.routing_heads:
        counts = np.stack([np.bincount(c.ravel(), minlength=3)
                           for c in keras.ops.convert_to_numpy(clusters["query_clusters"])])
        assert counts.max() > 8
    before = keras.ops.convert_to_numpy(layer.centroids) if layer.routing_heads else None
    got = _decode(layer, x, SCHEDULES[schedule])
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)
    if before is not None:  # decoding never moves the centroids
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(layer.centroids), before)


def test_a_wrong_rank_is_caught():
    """The keys a step sees follow the ranks kept in the cache: shifting
    every kept key rank by one chunk changes the outputs."""
    layer = _layer()
    x = _inputs(1)
    expected = keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    original = layer._records

    def shifted(cache):
        q, k, rank = original(cache)
        return q, k, rank + layer.window

    layer._records = shifted
    try:
        got = _decode(layer, x, SCHEDULES["prefill-then-steps"])
    finally:
        layer._records = original
    assert np.abs(got - expected).max() > 1e-3


@pytest.mark.skipif(BACKEND not in ("jax", "tensorflow"), reason="JAX's and TensorFlow's compilers")
def test_compiled_step_with_a_traced_index():
    layer = _layer()
    x = _inputs(2)
    expected = keras.ops.convert_to_numpy(layer(x, x, use_causal_mask=True))
    got = compiled_decoding(layer, x, prefill=7)
    np.testing.assert_allclose(got, expected, atol=TOL, rtol=0)


def test_cache_shape_and_refusals():
    layer = _layer()
    # keys, values and one slot of routing records (9 digits x 2 heads <= 3 x 8)
    assert layer.cache_shape(B, 64) == (B, 3, 64, 3, 8)
    mqa = _layer(num_heads=8, num_key_value_heads=1, key_dim=2, local_heads=0)
    assert mqa.cache_shape(B, 64) == (B, 2 + 36, 64, 1, 2)  # 9 x 8 digits in slots of 2
    with pytest.raises(ValueError, match="max_length=8388608"):
        layer.cache_shape(B, 8388608)
    x = _inputs()[:, :1]
    shared = _layer(shared_qk=True)
    with pytest.raises(ValueError, match="shared_qk=True has no decoding cache"):
        shared.init_cache(B, N)
    balanced = _layer(causal_routing="balanced")
    with pytest.raises(ValueError, match="balanced' has no decoding cache"):
        balanced(x, x, use_causal_mask=True, cache=layer.init_cache(B, N), cache_update_index=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_records_survive_a_low_precision_cache(dtype):
    """Clusters and ranks far beyond what bfloat16 holds as one number are
    read back exactly from a cache in that dtype (Keras casts the cache to
    the compute dtype under mixed precision)."""
    layer = _layer()
    S = 5
    cache = layer.init_cache(B, S, dtype=dtype)
    rng = np.random.default_rng(0)
    meta = rng.integers(0, 2 ** 23, size=(B, S, 3, layer.routing_heads)).astype("int32")
    keys = keras.ops.zeros((B, S, layer.num_key_value_heads, layer.key_dim), dtype)
    cache = layer._write(cache, keys, keys, keras.ops.convert_to_tensor(meta), 0)
    assert keras.backend.standardize_dtype(cache.dtype) == dtype
    got = [keras.ops.convert_to_numpy(r) for r in layer._records(cache)]
    for i in range(3):
        np.testing.assert_array_equal(got[i], np.transpose(meta[:, :, i], (0, 2, 1)))
