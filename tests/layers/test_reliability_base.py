"""Regression tests of issue 36 for what every layer inherits from
``BaseAttention``: a dense ``attention_mask`` marks padding, empty inputs,
``attend`` on padded heads, and ``last_implementation`` naming the code
that ran. The property suite (``test_properties.py``) checks the same
contracts on every layer; these pin the reproducers down."""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import FullAttention
from keras_longattn.layers import LocalAttention
from keras_longattn.layers import SparseAttention
from keras_longattn.layers import SynthesizerAttention
from keras_longattn.testing import rel_error

BACKEND = keras.backend.backend()
F = 16


def _x(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (FullAttention, {"implementation": "reference"}),
        (LocalAttention, {"window": 3, "implementation": "reference"}),
        (SynthesizerAttention, {"max_length": 16}),  # "auto" takes the dense mask
    ],
    ids=["full-reference", "local-reference", "synthesizer-auto"],
)
def test_keys_hidden_by_a_dense_mask_never_leak_nan(cls, kwargs):
    """Keys 7.. hidden from every query by ``attention_mask`` alone, NaN in
    their inputs: the real rows equal the call with zeros there (before
    the fix: NaN in every real row, 0 * NaN in the weighted sum)."""
    layer = cls(num_heads=2, key_dim=8, **kwargs)
    x = _x((2, 10, F))
    mask = np.ones((2, 10, 10), bool)
    mask[:, :, 7:] = False
    poisoned = x.copy()
    poisoned[:, 7:] = np.nan
    zeroed = x.copy()
    zeroed[:, 7:] = 0.0
    out = to_np(layer(poisoned, poisoned, attention_mask=mask))
    clean = to_np(layer(zeroed, zeroed, attention_mask=mask))
    assert np.all(np.isfinite(out[:, :7]))
    assert rel_error(out[:, :7], clean[:, :7]) < 1e-6


@pytest.mark.parametrize("shape", [(0, 7, F), (2, 0, F), (0, 0, F)])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_inputs_give_empty_outputs(shape, causal):
    """Empty batch, empty length, both: the output has the input's shape
    (TensorFlow's einsum turned (0, 0) into (1, 0) before), no path runs."""
    layer = LocalAttention(num_heads=2, key_dim=8, window=3)
    x = np.zeros(shape, "float32")
    out = layer(x, x, use_causal_mask=causal)
    assert tuple(out.shape) == shape
    assert layer.last_implementation == "empty"
    out, scores = layer(x, x, use_causal_mask=causal, return_attention_scores=True)
    assert tuple(scores.shape) == (shape[0], 2, shape[1], shape[1])


def test_cross_attention_with_no_keys_is_the_output_bias():
    """T > 0 queries and S = 0 keys: a query that sees no key gets a zero
    attention output, so the output is the output projection's bias."""
    layer = FullAttention(num_heads=2, key_dim=8, bias_initializer="ones")
    out = to_np(layer(_x((2, 5, F)), np.zeros((2, 0, F), "float32")))
    np.testing.assert_allclose(out, np.ones((2, 5, F)), atol=1e-6)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_attend_padded_heads_never_reach_real_outputs(poison):
    """``attend`` zeroes query heads marked by ``query_mask`` and key/value
    heads marked by ``key_mask`` (before the fix, NaN key heads reached
    every real output through 0 * NaN), and takes NumPy inputs."""
    layer = LocalAttention(num_heads=2, key_dim=8, window=3)
    layer.build((2, 12, F), (2, 12, F))
    keep = np.ones((2, 12), bool)
    keep[0, 9:] = False
    keep[1, :2] = False
    q, k, v = (_x((2, 12, 2, 8), s) for s in (1, 2, 3))
    bad = [np.where(keep[:, :, None, None], t, poison).astype("float32") for t in (q, k, v)]
    zero = [np.where(keep[:, :, None, None], t, 0.0).astype("float32") for t in (q, k, v)]
    out = to_np(layer.attend(*bad, query_mask=keep, key_mask=keep))
    clean = to_np(layer.attend(*zero, query_mask=keep, key_mask=keep))
    assert np.all(np.isfinite(out[keep]))
    assert rel_error(out[keep], clean[keep]) < 1e-6


@pytest.mark.skipif(BACKEND != "torch", reason="the compiled band kernel is torch's")
def test_last_implementation_says_whether_the_compiled_kernel_ran():
    """``band_kernel`` where the compiled kernel ran, ``band_kernel:flash``
    where the flash-kernel calls stood in for it."""
    from keras_longattn.kernels.torch import native

    x = _x((1, 64, F))
    for cls, kwargs in ((LocalAttention, {"window": 8}),
                        (SparseAttention, {"pattern": "strided", "block_length": 8})):
        layer = cls(num_heads=2, key_dim=8, implementation="band_kernel", **kwargs)
        with native.use_native(False):
            flash = to_np(layer(x, x, use_causal_mask=True))
            assert layer.last_implementation == "band_kernel:flash"
        compiled = to_np(layer(x, x, use_causal_mask=True))
        expected = "band_kernel" if native.ran_compiled() else "band_kernel:flash"
        assert layer.last_implementation == expected
        assert rel_error(compiled, flash) < 1e-5


def test_rotary_positions_with_a_length_unknown_while_tracing():
    """A model whose sequence axis is None with rotary positions predicts at
    two lengths, equal to direct calls (TensorFlow traced ``arange(None)``
    before the fix: "None values not supported")."""
    x_in = keras.Input((None, F))
    layer = LocalAttention(num_heads=2, key_dim=8, window=4, rotary_max_wavelength=100.0)
    model = keras.Model(x_in, layer(x_in, x_in, use_causal_mask=True))
    for n in (9, 13):
        x = _x((2, n, F), n)
        predicted = model.predict(x, verbose=0)
        direct = to_np(layer(x, x, use_causal_mask=True))
        np.testing.assert_allclose(predicted, direct, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("which", ["query", "value"])
def test_inputs_without_features_are_refused_at_build(which):
    """A feature axis of size 0 is refused when the layer is built, naming
    the input (before: accepted, with outputs of 0 features)."""
    shapes = {"query": (2, 5, F), "value": (2, 5, F)}
    shapes[which] = (2, 5, 0)
    layer = LocalAttention(num_heads=2, key_dim=8, window=3)
    with pytest.raises(ValueError, match=rf"`{which}` must be at least 1.*{which}.shape=\(2, 5, 0\)"):
        layer(np.zeros(shapes["query"], "float32"), np.zeros(shapes["value"], "float32"))
