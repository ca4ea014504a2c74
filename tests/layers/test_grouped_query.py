"""Grouped-query attention (``num_key_value_heads``): every layer equals
itself with the key and value heads repeated, weights come from
``keras.layers.GroupQueryAttention`` (and its sliding window maps to
LocalAttention, as does MultiHeadAttention's), and a decoding cache holds
the key/value heads only."""

import keras
import numpy as np
import pytest

from keras_longattn import layers as la_layers
from keras_longattn.layers import FullAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import SparseAttention

B, N, DIM, H, D = 2, 16, 16, 4, 8
TOL = 2e-5


def _x(seed=0, n=N):
    return np.random.default_rng(seed).normal(size=(B, n, DIM)).astype("float32")


def _np(x):
    return keras.ops.convert_to_numpy(x)


def _repeated_kv_twin(layer):
    """The same layer class with num_heads key/value heads whose weights
    are the grouped layer's, each key/value head repeated for its group."""
    config = layer.get_config()
    config["num_key_value_heads"] = None
    twin = type(layer).from_config(config)
    x = _x()
    twin(x, x)
    weights = []
    repeats = layer.num_heads // layer.num_key_value_heads
    names = [w.path for w in layer.weights]
    for name, w in zip(names, layer.get_weights()):
        if ("/key/" in name or "/value/" in name) and w.shape[-2] == layer.num_key_value_heads:
            w = np.repeat(w, repeats, axis=-2)
        weights.append(w)
    twin.set_weights(weights)
    return twin


CASES = {
    "full": lambda **k: FullAttention(num_heads=H, key_dim=D, **k),
    "local": lambda **k: LocalAttention(num_heads=H, key_dim=D, window=5, **k),
    "sparse": lambda **k: SparseAttention(num_heads=H, key_dim=D, block_length=4, **k),
}


GROUPINGS = [("full", False, 1), ("full", True, 2), ("local", True, 2), ("local", False, 1),
             ("sparse", True, 2)]


@pytest.mark.parametrize("kind,causal,kv_heads", GROUPINGS,
                         ids=[f"{k}-{'causal' if c else 'bidirectional'}-kv{h}"
                              for k, c, h in GROUPINGS])
def test_grouped_layer_equals_repeated_heads(kind, causal, kv_heads):
    keras.utils.set_random_seed(0)
    layer = CASES[kind](num_key_value_heads=kv_heads)
    x = _x()
    out = layer(x, x, use_causal_mask=causal)
    assert tuple(layer._key_dense.kernel.shape) == (DIM, kv_heads, D)
    twin = _repeated_kv_twin(layer)
    np.testing.assert_allclose(_np(out), _np(twin(x, x, use_causal_mask=causal)),
                               atol=TOL, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_weights_from_grouped_query_attention(window):
    keras.utils.set_random_seed(1)
    gqa = keras.layers.GroupQueryAttention(head_dim=D, num_query_heads=H,
                                             num_key_value_heads=2, sliding_window=window)
    x = _x(1)
    expected = _np(gqa(x, x, use_causal_mask=True))
    layer = FullAttention.from_grouped_query_attention(gqa)
    assert isinstance(layer, LocalAttention if window else FullAttention)
    assert layer.num_key_value_heads == 2
    np.testing.assert_allclose(_np(layer(x, x, use_causal_mask=True)), expected,
                               atol=TOL, rtol=0)
    if window:  # bidirectional: Keras's symmetric band
        np.testing.assert_allclose(_np(layer(x, x)), _np(gqa(x, x)), atol=TOL, rtol=0)


def test_multi_head_attention_sliding_window_maps_to_local():
    keras.utils.set_random_seed(2)
    mha = keras.layers.MultiHeadAttention(num_heads=H, key_dim=D, sliding_window=4)
    x = _x(2)
    expected = _np(mha(x, x, use_causal_mask=True))
    layer = FullAttention.from_multi_head_attention(mha)
    assert isinstance(layer, LocalAttention) and layer.extents(True) == (3, 0)
    np.testing.assert_allclose(_np(layer(x, x, use_causal_mask=True)), expected,
                               atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="sliding_window=4"):
        SparseAttention.from_multi_head_attention(mha, block_length=4)


def test_grouped_decoding_cache_holds_key_value_heads():
    keras.utils.set_random_seed(3)
    layer = LocalAttention(num_heads=H, key_dim=D, window=4, num_key_value_heads=1)
    x = _x(3, n=9)
    expected = _np(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(B, 9)
    assert tuple(cache.shape) == (B, 2, 3, 1, D)
    outs = []
    for i in range(9):
        out, cache = layer(x[:, i:i + 1], x[:, i:i + 1], use_causal_mask=True, cache=cache,
                           cache_update_index=i)
        outs.append(_np(out))
    np.testing.assert_allclose(np.concatenate(outs, 1), expected, atol=TOL, rtol=0)


def test_bad_grouping_is_refused():
    with pytest.raises(ValueError, match=r"num_key_value_heads.*num_heads=4, num_key_value_heads=3"):
        FullAttention(num_heads=4, key_dim=8, num_key_value_heads=3)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        FullAttention(num_heads=4, key_dim=8, num_key_value_heads=0)
    gated = keras.layers.GroupQueryAttention(head_dim=D, num_query_heads=H,
                                               num_key_value_heads=2, use_gate=True)
    gated(_x(), _x())
    with pytest.raises(ValueError, match="use_gate"):
        FullAttention.from_grouped_query_attention(gated)


def test_config_round_trip_keeps_the_grouping():
    layer = LocalAttention(num_heads=H, key_dim=D, window=4, num_key_value_heads=2)
    again = la_layers.LocalAttention.from_config(layer.get_config())
    assert again.num_key_value_heads == 2
    plain = LocalAttention(num_heads=H, key_dim=D, window=4)
    assert "num_key_value_heads" not in plain.get_config()  # configs of ungrouped layers unchanged
