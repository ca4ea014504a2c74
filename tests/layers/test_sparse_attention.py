import doctest

import keras
from keras.ops import convert_to_numpy as to_np
import numpy as np
import pytest

import keras_longattn
from keras_longattn.layers import sparse_attention as sparse_attention_module
from keras_longattn.layers.sparse_attention import SparseAttention
from keras_longattn.ops import sparse as sp
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import input_gradient
from keras_longattn.testing import rel_error


# ------------------------------------------------------------ conformance
# The default run: one class whose shapes most tests below share (the JAX
# backend compiles every op once per shape, which dominates the time); the
# ops tests check every pattern and combination against the reference.
class TestStridedMergedDefaultBlockLength(AttentionLayerConformance):
    """Default l = round(sqrt(n)): 6 at n=37 (not a multiple), 45 at n=2048."""

    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "strided",
                   "combination": "merged"}
    implementation = "blocked"
    reference_lengths = (37, 2048)


class TestFixedMultiheadFused(AttentionLayerConformance):
    """The fused path (no merged combination there): fixed A and B side by
    side, explicit block length and summary width."""

    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "fixed",
                   "block_length": 5, "summary_width": 2}
    implementation = "blocked_fused"
    secondary = True
    reference_lengths = (37,)


# Every pattern and combination through the whole suite: pass --run-slow.
@pytest.mark.slow
class TestFixedMultihead(AttentionLayerConformance):
    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "fixed",
                   "block_length": 5, "summary_width": 2}
    reference_lengths = (3, 16, 37, 2048)


@pytest.mark.slow
class TestStridedMultihead(AttentionLayerConformance):
    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "strided", "block_length": 4}
    reference_lengths = (5, 16, 37, 2048)


@pytest.mark.slow
class TestFixedMerged(AttentionLayerConformance):
    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "fixed",
                   "block_length": 5, "summary_width": 2, "combination": "merged"}
    reference_lengths = (16, 37, 2048)


@pytest.mark.slow
class TestFixedMergedDefaults(AttentionLayerConformance):
    """Default l and c: l = 6, c = 1 at n=37; l = 45, c = 5 at n=2048."""

    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "fixed",
                   "combination": "merged"}
    reference_lengths = (37, 2048)


@pytest.mark.slow
class TestStridedFirstThreeHeads(AttentionLayerConformance):
    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 3, "key_dim": 8, "pattern": "strided",
                   "block_length": 5, "combination": "first"}
    reference_lengths = (16, 37)


@pytest.mark.slow
class TestStridedSecondRemat(AttentionLayerConformance):
    # Not fixed/"second": there the causal queries before the first summary
    # cell see no key at all (zero output, zero gradient), by definition,
    # which the suite's causality check does not expect.
    layer_cls = SparseAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "pattern": "strided",
                   "block_length": 5, "combination": "second", "remat": True}
    reference_lengths = (16, 37)


# -------------------------------------------------------- layer specifics
def _pair(**kwargs):
    """An efficient layer and a reference layer with the same weights."""
    layer = SparseAttention(num_heads=kwargs.pop("num_heads", 2), key_dim=8, **kwargs)
    x = np.zeros((1, 4, 16), "float32")
    layer(x, x)
    config = layer.get_config()
    config["implementation"] = "reference"
    ref = SparseAttention.from_config(config)
    ref(x, x)
    ref.set_weights(layer.get_weights())
    return layer, ref


def test_weights_show_each_heads_pattern():
    """return_attention_scores gives each head's own pattern: with
    "multihead" and 3 heads, heads 0 and 1 attend A, head 2 attends B."""
    layer = SparseAttention(num_heads=3, key_dim=8, pattern="fixed", block_length=5,
                            summary_width=2)
    x = np.random.default_rng(0).standard_normal((1, 16, 16)).astype("float32")
    _, scores = layer(x, x, use_causal_mask=True, return_attention_scores=True)
    scores = to_np(scores)[0]
    first, second = sp.sparse_transformer_patterns("fixed", 5, 2, causal=True)
    a, b = to_np(first.dense_mask(16, 16)), to_np(second.dense_mask(16, 16))
    for h, allowed in ((0, a), (1, a), (2, b)):
        assert np.all(scores[h][~allowed] == 0.0)
        assert np.all(scores[h][allowed] > 0.0)
        # Rows 0-2 of B see no summary cell yet: zero rows.
        np.testing.assert_allclose(scores[h].sum(-1), allowed.any(-1), rtol=1e-5)


def test_layer_patterns_and_default_lengths():
    layer = SparseAttention(num_heads=2, key_dim=8, pattern="fixed")
    assert layer.resolve_block_length(2048) == 45
    assert layer.resolve_summary_width(45) == 5
    assert layer.resolve_block_length(3) == 2
    layer = SparseAttention(num_heads=2, key_dim=8, pattern="fixed", summary_width=4)
    assert layer.resolve_block_length(9) == 5  # at least summary_width + 1
    layer = SparseAttention(num_heads=4, key_dim=8, block_length=3)
    heads = layer.head_patterns(10, 10, causal=True)
    first, second = sp.sparse_transformer_patterns("strided", 3, causal=True)
    assert heads == (first, first, second, second)
    union = to_np(layer.attention_pattern(10, 10, True).dense_mask(10, 10))
    expected = to_np(first.dense_mask(10, 10)) | to_np(second.dense_mask(10, 10))
    np.testing.assert_array_equal(union, expected)


@pytest.mark.slow
def test_cross_attention_and_long_block():
    """T != S, and block lengths longer than the sequences (allowed: the
    sequence is one block, computed on l padded positions)."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 11, 16)).astype("float32")
    for kwargs, s in (({"pattern": "fixed", "block_length": 16, "summary_width": 3,
                        "combination": "merged"}, 15),
                      ({"pattern": "strided", "block_length": 32}, 7)):
        kv = rng.standard_normal((2, s, 16)).astype("float32")
        layer, ref = _pair(**kwargs)
        for causal in (True, False):
            out = to_np(layer(q, kv, use_causal_mask=causal))
            assert layer.last_implementation in ("blocked", "blocked_fused")
            expected = to_np(ref(q, kv, use_causal_mask=causal))
            assert rel_error(out, expected) < 1e-5, (kwargs, causal)


def test_interleaved_first_and_second_give_the_paper_per_block_alternative():
    """Two layers, "first" then "second", in alternating residual blocks:
    the configs survive in the model's config. (That "first" and "second"
    equal dense attention under A and B alone is checked in
    tests/ops/test_sparse_patterns.py.)"""
    x = np.random.default_rng(2).standard_normal((2, 37, 16)).astype("float32")
    inp = keras.Input((37, 16))
    h = inp
    for combination in ("first", "second"):
        att = SparseAttention(num_heads=2, key_dim=8, pattern="strided",
                              combination=combination)
        h = h + att(h, h, use_causal_mask=True)
    model = keras.Model(inp, h)
    config = model.get_config()
    layers = [c for c in config["layers"] if c["class_name"] == "SparseAttention"]
    assert [c["config"]["combination"] for c in layers] == ["first", "second"]
    assert np.all(np.isfinite(to_np(model(x))))


def test_remat_gives_the_same_values_and_gradients():
    # Shapes of TestStridedMergedDefaultBlockLength (compiled once).
    x = np.random.default_rng(3).standard_normal((1, 37, 16)).astype("float32")
    plain = SparseAttention(num_heads=2, key_dim=8, pattern="strided",
                            combination="merged")
    plain(x, x)
    remat = SparseAttention.from_config({**plain.get_config(), "remat": True})
    remat(x, x)
    remat.set_weights(plain.get_weights())
    np.testing.assert_allclose(to_np(remat(x, x, use_causal_mask=True)),
                               to_np(plain(x, x, use_causal_mask=True)), rtol=1e-6, atol=1e-6)
    grads = [input_gradient(lambda v, l=l: l(v, v, use_causal_mask=True), x)
             for l in (plain, remat)]
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pattern": "dilated"}, "pattern='dilated'"),
        ({"combination": "sum"}, "combination='sum'"),
        ({"block_length": 0}, "block_length=0"),
        ({"block_length": 2.5}, "block_length=2.5"),
        ({"pattern": "fixed", "summary_width": 0}, "summary_width=0"),
        ({"pattern": "fixed", "block_length": 4, "summary_width": 4}, "summary_width=4"),
        ({"pattern": "fixed", "block_length": 1}, "block_length=1"),
        ({"pattern": "strided", "summary_width": 2}, "summary_width=2"),
        ({"remat": "yes"}, "remat='yes'"),
        ({"remat": True, "dropout": 0.1}, "dropout=0.1"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseAttention(num_heads=2, key_dim=8, **kwargs)


def test_docstring_example(monkeypatch):
    # The example uses the public path; it works before and after the
    # layer is exported from keras_longattn.layers.
    monkeypatch.setattr(keras_longattn.layers, "SparseAttention", SparseAttention,
                        raising=False)
    result = doctest.testmod(sparse_attention_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
