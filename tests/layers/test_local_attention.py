import keras
import numpy as np
from keras.ops import convert_to_numpy as to_np
import pytest

from keras_longattn.layers import LocalAttention
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error


class TestLocalAttention(AttentionLayerConformance):
    layer_cls = LocalAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 6}
    implementation = "blocked"
    reference_lengths = (5, 16, 37, 2048)


class TestLocalAttentionLargeWindow(AttentionLayerConformance):
    """Window longer than some sequences, explicit extents, odd block size."""

    layer_cls = LocalAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "look_back": 9, "look_ahead": 3,
                   "block_size": 5}
    reference_lengths = (3, 23, 64)


def test_window_semantics_match_definition():
    """The pattern of a causal call is exactly keys i-w+1..i; bidirectional
    is i-w//2..i+w//2 (checked against an explicit loop)."""
    layer = LocalAttention(num_heads=1, key_dim=4, window=5)
    n = 12
    for causal in (True, False):
        mask = to_np(layer.attention_pattern(n, n, causal).dense_mask(n, n))
        expected = np.zeros((n, n), bool)
        for i in range(n):
            for j in range(n):
                if causal:
                    expected[i, j] = i - 5 + 1 <= j <= i
                else:
                    expected[i, j] = abs(i - j) <= 5 // 2
        np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("block_size", [1, 3, 8, 64])
def test_block_size_does_not_change_the_result(block_size):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 29, 16)).astype("float32")
    base = LocalAttention(num_heads=2, key_dim=8, window=7)
    y0 = to_np(base(x, x, use_causal_mask=True))
    other = LocalAttention(num_heads=2, key_dim=8, window=7, block_size=block_size)
    other(x, x)
    other.set_weights(base.get_weights())
    assert rel_error(to_np(other(x, x, use_causal_mask=True)), y0) < 1e-5


def test_cross_attention_with_different_lengths():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 11, 16)).astype("float32")
    kv = rng.standard_normal((2, 19, 16)).astype("float32")
    layer = LocalAttention(num_heads=2, key_dim=8, window=4)
    out = to_np(layer(q, kv))
    ref = LocalAttention(num_heads=2, key_dim=8, window=4, implementation="reference")
    ref(q, kv)
    ref.set_weights(layer.get_weights())
    assert rel_error(out, to_np(ref(q, kv))) < 1e-5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": 0}, "window=0"),
        ({"window": None}, "window=None"),
        ({"window": 4, "look_back": -1}, "look_back=-1"),
        ({"window": 4, "look_ahead": -2}, "look_ahead=-2"),
        ({"window": 4, "block_size": 0}, "block_size=0"),
        ({"window": 2.5}, "window=2.5"),
    ],
)
def test_bad_window_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LocalAttention(num_heads=2, key_dim=8, **kwargs)


class TestLocalAttentionRotary(AttentionLayerConformance):
    """Rotary positions inside the layer keep every property of the contract."""

    layer_cls = LocalAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 8, "rotary_max_wavelength": 1000.0}
    reference_lengths = (19,)


class TestLocalAttentionFused(AttentionLayerConformance):
    """The fused block path (keras.ops.dot_product_attention per block).

    It is the path ``"auto"`` takes on torch, where it runs the whole suite;
    on jax and tensorflow (where ``"auto"`` takes ``"blocked"``) it runs as
    a secondary implementation: equality with the reference, padding,
    causality and dispatch."""

    layer_cls = LocalAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 6}
    implementation = "blocked_fused"
    secondary = keras.backend.backend() != "torch"
    reference_lengths = (5, 37, 2048)


def test_fused_path_refuses_dropout_in_training():
    x = np.random.default_rng(0).standard_normal((1, 9, 16)).astype("float32")
    layer = LocalAttention(num_heads=2, key_dim=8, window=4, dropout=0.2, implementation="blocked_fused")
    with pytest.raises(ValueError, match="dropout"):
        layer(x, x, training=True)
    auto = LocalAttention(num_heads=2, key_dim=8, window=4, dropout=0.2)
    auto(x, x, training=True)
    assert auto.last_implementation == "blocked"
