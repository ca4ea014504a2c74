"""LongformerAttention: the conformance suite, the global mask per call, the
global projections and the semantics of the pattern against explicit loops.

CI budget: one conformance class (global tokens, per-head dilation, lengths
16, 37 and one long causal length), and layer tests that reuse its shapes
(n = 37 or 12, batch 2): JAX compiles every new shape.
"""

import os

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn import ops as la_ops
from keras_longattn.layers import LongformerAttention
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import input_gradient
from keras_longattn.testing import rel_error

N = 37  # the conformance suite's short length


# ------------------------------------------------------------ conformance
class TestLongformerAttention(AttentionLayerConformance):
    """Two leading global tokens (padded away in example 1 of the padding
    checks), heads dilated 1 and 2, an even window that is not a multiple
    of the blocks."""

    layer_cls = LongformerAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 6, "dilation": [1, 2],
                   "global_tokens": 2}
    implementation = "blocked"
    reference_lengths = (16, 37, 2048)


class TestLongformerAttentionFused(AttentionLayerConformance):
    """The fused path (preferred by "auto" on PyTorch): the global keys
    appended to every window block, one softmax."""

    layer_cls = LongformerAttention
    init_kwargs = TestLongformerAttention.init_kwargs
    implementation = "blocked_fused"
    secondary = True
    reference_lengths = (37,)


@pytest.mark.slow
class TestLongformerAttentionSlidingOnly(AttentionLayerConformance):
    """No global token: a plain sliding window, equal on every head (the
    default run covers it in test_global_mask_equals_reference's calls
    without a mask)."""

    layer_cls = LongformerAttention
    init_kwargs = {"num_heads": 2, "key_dim": 8, "window": 4}
    implementation = "blocked"
    secondary = True
    reference_lengths = (37,)


# ---------------------------------------------------------------- helpers
def _inputs(n=N, batch=2, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, n, 16)).astype("float32")


def _global_mask(n=N):
    mask = np.zeros((2, n), bool)
    mask[0, [3, 20]] = True
    mask[1, [0, 5, n - 1]] = True
    return mask


def _pair(implementation="blocked", **kwargs):
    """A layer and its reference on the same weights."""
    kwargs = {"num_heads": 2, "key_dim": 8, "window": 6, "dilation": [1, 2], **kwargs}
    layer = LongformerAttention(implementation=implementation, **kwargs)
    ref = LongformerAttention(implementation="reference", **kwargs)
    x = _inputs()
    layer(x, x)
    ref(x, x)
    ref.set_weights(layer.get_weights())
    return layer, ref


# ------------------------------------------------------------- global mask
@pytest.mark.parametrize(
    "causal, implementation",
    [(False, "blocked"), (True, "blocked"), (False, "blocked_fused"),
     pytest.param(True, "blocked_fused", marks=pytest.mark.slow)],
)
def test_global_mask_equals_reference(causal, implementation):
    """Per-example global positions, with padding, per-head dilation; and
    the (dilated) sliding window alone."""
    layer, ref = _pair(implementation=implementation)
    x = _inputs()
    pad = np.ones((2, N), bool)
    pad[0, N - 8 :] = False
    pad[1, :3] = False
    gm = _global_mask()
    for kwargs in ({"global_mask": gm}, {"global_mask": gm, "value_mask": pad,
                                         "query_mask": pad},
                   {"value_mask": pad, "query_mask": pad}):  # sliding only
        out = to_np(layer(x, x, use_causal_mask=causal, **kwargs))
        assert layer.last_implementation == implementation
        expected = to_np(ref(x, x, use_causal_mask=causal, **kwargs))
        real = kwargs.get("query_mask", np.ones((2, N), bool))
        assert rel_error(out[real], expected[real]) < 1e-5
        assert np.all(np.isfinite(out))


def test_integer_global_mask_and_mask_overrides_global_tokens():
    layer, _ = _pair(global_tokens=3)
    x = _inputs()
    gm = _global_mask()
    as_bool = to_np(layer(x, x, global_mask=gm))
    as_int = to_np(layer(x, x, global_mask=gm.astype("int32")))
    np.testing.assert_allclose(as_int, as_bool, rtol=1e-6, atol=1e-6)
    # The mask replaces the constructor's leading global tokens.
    without = to_np(layer(x, x))
    assert not np.allclose(without, as_bool)


def test_max_global_keeps_the_first_global_positions():
    """Global positions beyond ``max_global`` per example are ordinary ones,
    in the efficient path and in the reference alike."""
    layer, ref = _pair(max_global=2)
    x = _inputs()
    gm = _global_mask()  # example 1 has 3 global positions
    out = to_np(layer(x, x, global_mask=gm))
    np.testing.assert_allclose(out, to_np(ref(x, x, global_mask=gm)), rtol=1e-5, atol=1e-5)
    first_two = gm.copy()
    first_two[1, N - 1] = False
    np.testing.assert_allclose(out, to_np(layer(x, x, global_mask=first_two)),
                               rtol=1e-6, atol=1e-6)


def test_causal_global_mask_is_leak_free():
    """Causal mode: later positions, global or not, never reach an earlier
    output (by perturbation and by gradient)."""
    layer, _ = _pair()
    x = _inputs()
    gm = _global_mask()
    y = to_np(layer(x, x, global_mask=gm, use_causal_mask=True))
    for t in (2, 19, N - 3):
        x2 = x.copy()
        x2[:, t + 1 :] = 10 * np.random.default_rng(t).standard_normal(x2[:, t + 1 :].shape)
        y2 = to_np(layer(x2, x2, global_mask=gm, use_causal_mask=True))
        np.testing.assert_allclose(y2[:, : t + 1], y[:, : t + 1], rtol=1e-6, atol=1e-6)
    t = 4  # after the global position 3 of example 0, before 20
    g = input_gradient(
        lambda inp: layer(inp, inp, global_mask=gm, use_causal_mask=True)[:, t], x
    )
    assert np.all(g[:, t + 1 :] == 0.0)
    assert np.any(g[:, : t + 1] != 0.0)


def test_functional_model_with_a_global_mask_input(tmp_path):
    """A Keras-friendly input: ``keras.Input((n,), dtype="bool")``, saved
    and loaded as a .keras file."""
    tokens = keras.Input((N, 16))
    glob = keras.Input((N,), dtype="bool")
    out = LongformerAttention(num_heads=2, key_dim=8, window=6)(
        tokens, tokens, global_mask=glob
    )
    model = keras.Model([tokens, glob], out)
    x, gm = _inputs(), _global_mask()
    expected = to_np(model([x, gm]))
    path = os.path.join(str(tmp_path), "longformer.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_np(loaded([x, gm])), expected, rtol=1e-6, atol=1e-6)


# --------------------------------------------------- semantics, projections
def _loop_reference(layer, x, window, dilations, global_positions, causal):
    """Longformer by its definition, with NumPy loops over (head, query)."""
    w = {v.path.split("/", 1)[1]: to_np(v) for v in layer.weights}

    def proj(name):
        return np.einsum("btc,chd->bthd", x, w[f"{name}/kernel"]) + w[f"{name}/bias"]

    local = [proj(n) for n in ("query", "key", "value")]
    glob = [proj(n) for n in ("query_global", "key_global", "value_global")]
    B, n = x.shape[:2]
    H, d = w["query/kernel"].shape[1:]
    out = np.zeros((B, n, H, d), "float64")
    for b in range(B):
        for h, r in enumerate(dilations):
            for i in range(n):
                steps = range(-window, 1) if causal else range(-window // 2, window // 2 + 1)
                keys = {i + r * t for t in steps if 0 <= i + r * t < n}
                keys |= set(global_positions[b])
                if i in global_positions[b]:
                    keys = set(range(n))
                if causal:
                    keys = {j for j in keys if j <= i}
                keys = sorted(keys)
                q, k, v = glob if i in global_positions[b] else local
                logits = k[b, keys, h] @ q[b, i, h] / np.sqrt(d)
                p = np.exp(logits - logits.max())
                out[b, i, h] = (p / p.sum()) @ v[b, keys, h]
    return np.einsum("bthd,hdo->bto", out, w["attention_output/kernel"]) + w[
        "attention_output/bias"
    ]


@pytest.mark.parametrize("causal", [False, True])
def test_matches_the_definition(causal):
    """The reference and the efficient path both equal an explicit loop
    over the paper's definition, global projections included (random
    global weights, so that they differ from the local ones)."""
    x = _inputs()
    gm = _global_mask()
    for implementation in ("blocked", "reference"):
        layer = LongformerAttention(num_heads=2, key_dim=8, window=6, dilation=[1, 2],
                                    bias_initializer="random_normal",
                                    implementation=implementation)
        layer(x, x)
        if implementation == "blocked":
            weights = layer.get_weights()
        else:
            layer.set_weights(weights)
        out = to_np(layer(x, x, global_mask=gm, use_causal_mask=causal))
        expected = _loop_reference(layer, x, 6, (1, 2), ([3, 20], [0, 5, N - 1]), causal)
        assert rel_error(out, expected) < 1e-5, implementation


def test_from_multi_head_attention_copies_the_global_projections():
    """MultiHeadAttention's weights load as they are (global projections
    copied from the local ones): with a window covering the sequence the
    layer then equals MultiHeadAttention, global tokens or not."""
    x = _inputs()
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    mha(x, x)
    layer = LongformerAttention.from_multi_head_attention(mha, window=2 * N, global_tokens=2)
    names = [v.path.split("/", 1)[1] for v in layer.weights]
    assert names[:8] == [v.path.split("/", 1)[1] for v in mha.weights]
    assert [n.split("/")[0] for n in names[8:]] == ["query_global"] * 2 + [
        "key_global"] * 2 + ["value_global"] * 2
    for causal in (False, True):
        np.testing.assert_allclose(
            to_np(layer(x, x, global_mask=_global_mask(), use_causal_mask=causal)),
            to_np(mha(x, x, use_causal_mask=causal)), rtol=1e-5, atol=1e-5,
        )


def test_blocked_path_builds_no_dense_mask(monkeypatch):
    """Per-head dilation and global tokens without a dense mask: the
    blocked path never asks a pattern for its (T, S) mask."""
    layer, ref = _pair(global_tokens=1)
    x = _inputs()
    expected = to_np(ref(x, x, global_mask=_global_mask()))

    def refuse(*args, **kwargs):
        raise AssertionError("dense mask built")

    monkeypatch.setattr(la_ops.AttentionPattern, "dense_mask", refuse)
    out = to_np(layer(x, x, global_mask=_global_mask()))
    assert rel_error(out, expected) < 1e-5


def test_patterns_match_their_definition():
    n = 12
    dilated = to_np(la_ops.DilatedPattern(2, 1, 3).dense_mask(n, n))
    glob = to_np(la_ops.GlobalPattern((0, 5)).dense_mask(n, n))
    for i in range(n):
        for j in range(n):
            assert dilated[i, j] == ((j - i) % 3 == 0 and -6 <= j - i <= 3)
            assert glob[i, j] == (i in (0, 5) or j in (0, 5))
    layer = LongformerAttention(num_heads=2, key_dim=8, window=4, dilation=[1, 2],
                                global_tokens=1)
    heads = layer.head_patterns(n, n, causal=True)
    assert len(heads) == 2 and all(p.is_causal for p in heads)
    union = to_np(layer.attention_pattern(n, n, causal=False).dense_mask(n, n))
    assert union[0].all() and union[:, 0].all()  # the global token
    assert union[6, 2] and union[6, 4] and not union[6, 1]  # i - 2*2, i - 2, not i - 5


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window": 0}, "window=0"),
        ({"window": 5}, "window=5"),
        ({"window": 4.0}, "window=4.0"),
        ({"dilation": 0}, "dilation=0"),
        ({"dilation": [1, 2, 3]}, r"dilation=\[1, 2, 3\]"),
        ({"dilation": [1, 0]}, r"dilation=\[1, 0\]"),
        ({"global_tokens": -1}, "global_tokens=-1"),
        ({"max_global": 0}, "max_global=0"),
        ({"block_size": 0}, "block_size=0"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    kwargs = {"num_heads": 2, "key_dim": 8, "window": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        LongformerAttention(**kwargs)


def test_bad_global_mask():
    layer = LongformerAttention(num_heads=2, key_dim=8, window=4)
    x = _inputs()
    with pytest.raises(ValueError, match=r"global_mask.shape=\(2, 36\)"):
        layer(x, x, global_mask=np.ones((2, N - 1), bool))
    with pytest.raises(ValueError, match=r"global_mask.shape=\(2, 37, 1\)"):
        layer(x, x, global_mask=np.ones((2, N, 1), bool))
    with pytest.raises(ValueError, match="global_mask.dtype=float32"):
        layer(x, x, global_mask=np.ones((2, N), "float32"))
    with pytest.raises(ValueError, match="key length 36"):
        layer(x, x[:, 1:], global_mask=np.ones((2, N), bool))


@pytest.mark.grid
@pytest.mark.parametrize("implementation", ["blocked", "blocked_fused"])
def test_rotary_positions_with_global_rows(implementation):
    """Rotary positions: the global rows are rotated at their own positions
    (projected for every position, then gathered)."""
    layer, ref = _pair(implementation=implementation, rotary_max_wavelength=100.0)
    x, gm = _inputs(), _global_mask()
    for causal in (False, True):
        out = to_np(layer(x, x, global_mask=gm, use_causal_mask=causal))
        expected = to_np(ref(x, x, global_mask=gm, use_causal_mask=causal))
        assert rel_error(out, expected) < 1e-5


# ------------------------------------------- global rows in input space
@pytest.mark.parametrize("causal, implementation",
                         [(False, "blocked"), (True, "blocked"), (True, "blocked_fused")])
def test_global_rows_in_input_space_equal_projected_keys(causal, implementation):
    """The blocked paths compute the global rows from the inputs and the
    global key/value kernels (no projection of every position): outputs
    and the gradients of every weight (the global projections' included)
    equal the reference, which projects every key. Query, key and value
    inputs differ (a swapped input would show), with padding and biases."""
    from keras_longattn.testing.gradients import weight_gradients

    # Seeded initialisers too: an unseeded draw once put a gradient at the
    # 1e-4 tolerance (jax, one run in about ten).
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, N, 16)).astype("float32") for _ in range(3))
    pad = np.ones((2, N), bool)
    pad[0, N - 5 :] = False
    gm = _global_mask()
    kwargs = {"num_heads": 2, "key_dim": 8, "window": 6, "global_tokens": 1}
    layer = LongformerAttention(implementation=implementation, **kwargs)
    ref = LongformerAttention(implementation="reference", **kwargs)
    layer(q, v, key=k)
    ref(q, v, key=k)
    weights = [w + rng.standard_normal(w.shape).astype("float32") * 0.3
               for w in layer.get_weights()]  # non-zero biases
    layer.set_weights(weights)
    ref.set_weights(weights)
    call = {"key": k, "global_mask": gm, "value_mask": pad, "use_causal_mask": causal}

    def loss(lay):
        out = lay(q, v, **call)
        return keras.ops.sum(keras.ops.sin(out) * (1.0 + keras.ops.arange(16, dtype="float32")))

    out, expected = to_np(layer(q, v, **call)), to_np(ref(q, v, **call))
    assert rel_error(out, expected) < 1e-5
    got, want = weight_gradients(layer, lambda: loss(layer)), weight_gradients(ref, lambda: loss(ref))
    names = [w.path for w in layer.trainable_variables]
    for name, g, w in zip(names, got, want):
        # Key biases shift every score of a row equally: softmax-invariant.
        if "key/bias" in name or "key_global/bias" in name:  # zero up to rounding
            assert np.abs(g).max() < 1e-4 and np.abs(w).max() < 1e-4, name
            continue
        assert g is not None, name
        assert rel_error(g, w) < 1e-4, name

    def no_projection(*args, **kwargs):
        raise AssertionError("the global keys were projected at every position")

    layer._key_global_dense.call = no_projection
    layer._value_global_dense.call = no_projection
    assert rel_error(to_np(layer(q, v, **call)), expected) < 1e-5
