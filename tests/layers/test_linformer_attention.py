"""LinformerAttention: the conformance suite for each implementation, a
NumPy loop of the layer, padding masked before the projection, the four
kinds of sharing (layerwise through a .keras file), the full-attention
limit, linear memory and bad input."""

import os

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import FullAttention
from keras_longattn.layers import LinformerAttention
from keras_longattn.layers import LinformerProjection
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error

BACKEND = keras.backend.backend()
KWARGS = {"num_heads": 2, "key_dim": 8, "k": 8, "max_length": 64}


# ---------------------------------------------------------- conformance
class TestLinformerProjected(AttentionLayerConformance):
    """Headwise sharing (the default), explicit weights over the slots."""

    layer_cls = LinformerAttention
    init_kwargs = KWARGS
    implementation = "projected"
    # max_length caps the lengths (64): 16 and 37 (37 not a multiple of k).
    reference_lengths = (16, 37)


class TestLinformerFused(AttentionLayerConformance):
    """One E and F per head, through the fused kernel."""

    layer_cls = LinformerAttention
    init_kwargs = dict(KWARGS, sharing="none")
    implementation = "projected_fused"
    secondary = True
    reference_lengths = (37,)


# ------------------------------------------------------------- helpers
def _x(B=2, T=37, F=16, seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, F)).astype("float32")


def _built(x=None, **kwargs):
    layer = LinformerAttention(**dict(KWARGS, **kwargs))
    x = _x() if x is None else x
    layer(x, x)
    return layer


def numpy_linformer(layer, query, value, value_mask=None):
    """The layer in NumPy (float64), one example and head at a time:
    padded rows of K and V zeroed, E K and F V with the leading S columns,
    softmax over the k slots, the output projection."""
    q = to_np(layer._query_dense(query)).astype("float64")
    k = to_np(layer._key_dense(value)).astype("float64")
    v = to_np(layer._value_dense(value)).astype("float64")
    B, T, H, d = q.shape
    S = k.shape[1]
    keep = np.ones((B, S), bool) if value_mask is None else np.asarray(value_mask, bool)
    E = to_np(layer._key_projection.kernel).astype("float64")[..., :S]
    F = to_np(layer._value_projection.kernel).astype("float64")[..., :S]
    out = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            Eh = E[h] if E.ndim == 3 else E
            Fh = F[h] if F.ndim == 3 else F
            ek = Eh @ (k[b, :, h] * keep[b, :, None])  # (k, d)
            fv = Fh @ (v[b, :, h] * keep[b, :, None])
            logits = q[b, :, h] @ ek.T / np.sqrt(d)  # (T, k)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[b, :, h] = w @ fv
    kernel, bias = (to_np(w).astype("float64") for w in layer._output_dense.weights)
    return np.einsum("bthd,hdo->bto", out, kernel) + bias


# ----------------------------------------------------------- definition
@pytest.mark.parametrize(
    "sharing",
    # "none" is the same keras.ops code with per-head matrices (its fused
    # path runs the conformance suite on every backend): torch only in CI.
    ["headwise", pytest.param("none", marks=pytest.mark.grid)],
)
def test_paths_equal_numpy_loop(sharing):
    """Shorter inputs (37 of max_length 64) use the leading columns of E
    and F; every path equals an independent NumPy loop, with padding."""
    x = _x()
    mask = np.ones((2, 37), bool)
    mask[1, 30:] = False
    layer = _built(x, sharing=sharing)
    expected = numpy_linformer(layer, x, x, value_mask=mask)
    for impl in ("projected", "projected_fused", "reference"):
        config = dict(layer.get_config(), implementation=impl)
        other = LinformerAttention.from_config(config)
        other(x, x)
        other.set_weights(layer.get_weights())
        out = to_np(other(x, x, query_mask=mask, value_mask=mask))
        assert other.last_implementation == impl
        assert rel_error(out[mask], expected[mask]) < 1e-5, impl


# --------------------------------------------------------------- padding
def test_padding_is_masked_before_the_projection():
    """A right-padded example gives the output of the example alone: the
    padded keys and values (their projections' biases included) enter E K
    and F V as zeros, whatever the padded inputs hold. Without the mask the
    padded rows change the result (the test has teeth)."""
    layer = _built()
    x = _x()
    n = 25
    mask = np.ones((2, 37), bool)
    mask[0, n:] = False
    y = to_np(layer(x, x, query_mask=mask, value_mask=mask))
    alone = to_np(layer(x[:1, :n], x[:1, :n]))
    assert rel_error(y[0, :n], alone[0]) < 1e-5
    poisoned = x.copy()
    poisoned[0, n:] = 1e4
    y2 = to_np(layer(poisoned, poisoned, query_mask=mask, value_mask=mask))
    np.testing.assert_allclose(y2[mask], y[mask], rtol=1e-5, atol=1e-5)
    unmasked = to_np(layer(x, x))
    assert rel_error(unmasked[0, :n], alone[0]) > 1e-3


# --------------------------------------------------------------- sharing
def test_sharing_variables():
    """none: per-head E and F; headwise: one E, one F; key_value: E = F
    (one variable); each after the projections of MultiHeadAttention."""
    shapes = {
        "none": [(2, 8, 64), (2, 8, 64)],
        "headwise": [(8, 64), (8, 64)],
        "key_value": [(8, 64)],
    }
    for sharing, expected in shapes.items():
        layer = _built(sharing=sharing)
        assert [tuple(w.shape) for w in layer.weights[8:]] == expected, sharing
    layer = _built(sharing="key_value")
    assert layer._key_projection is layer._value_projection


def test_headwise_equals_per_head_copies():
    """One E and F for all heads is sharing="none" with the same matrix in
    every head."""
    x = _x()
    shared = _built(x, sharing="headwise")
    per_head = _built(x, sharing="none")
    weights = shared.get_weights()
    per_head.set_weights(weights[:8] + [np.stack([w, w]) for w in weights[8:]])
    np.testing.assert_allclose(to_np(per_head(x, x)), to_np(shared(x, x)),
                               rtol=1e-5, atol=1e-5)


def test_layerwise_sharing_survives_a_keras_file(tmp_path):
    """Two layers share one LinformerProjection: the model holds one
    variable for it, a .keras file stores it once, and the loaded layers
    share one object (assigning the kernel through one changes the other's
    output)."""
    shared = LinformerProjection(k=4, max_length=32)
    inp = keras.Input((20, 16))
    h = LinformerAttention(num_heads=2, key_dim=8, projection=shared)(inp, inp)
    out = LinformerAttention(num_heads=2, key_dim=8, projection=shared)(h, h)
    model = keras.Model(inp, out)
    assert len(model.weights) == 2 * 8 + 1
    x = _x(T=20)
    expected = to_np(model(x))
    path = os.path.join(str(tmp_path), "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    np.testing.assert_allclose(to_np(loaded(x)), expected, rtol=1e-6, atol=1e-6)
    assert len(loaded.weights) == 2 * 8 + 1
    first, second = [l for l in loaded.layers if isinstance(l, LinformerAttention)]
    assert first.sharing == second.sharing == "layerwise"
    assert first.projection is second.projection
    assert first._key_projection.kernel is second._value_projection.kernel
    before = to_np(second(x, x))
    first.projection.kernel.assign(2.0 * to_np(first.projection.kernel))
    np.testing.assert_allclose(to_np(second.projection.kernel),
                               to_np(first.projection.kernel))
    assert rel_error(to_np(second(x, x)), before) > 1e-3


def test_layerwise_arguments():
    shared = LinformerProjection(k=4, max_length=32)
    layer = LinformerAttention(num_heads=2, key_dim=8, projection=shared)
    assert (layer.k, layer.max_length, layer.sharing) == (4, 32, "layerwise")
    with pytest.raises(ValueError, match=r"needs the shared matrix.*projection=None"):
        LinformerAttention(num_heads=2, key_dim=8, sharing="layerwise")
    with pytest.raises(ValueError, match=r"sharing='headwise' with a projection"):
        LinformerAttention(num_heads=2, key_dim=8, sharing="headwise", projection=shared)
    with pytest.raises(ValueError, match=r"k=4\).*Received: k=8"):
        LinformerAttention(num_heads=2, key_dim=8, k=8, projection=shared)
    with pytest.raises(ValueError, match=r"Received: projection='E'"):
        LinformerAttention(num_heads=2, key_dim=8, projection="E")
    with pytest.raises(ValueError, match=r"Received: num_heads=2"):
        LinformerAttention(num_heads=2, key_dim=8,
                           projection=LinformerProjection(4, 32, num_heads=3))


# ------------------------------------------------------- limits, errors
def test_identity_limit_equals_full_attention():
    """k = n and identity E = F: FullAttention on the same weights (also
    with cross-attention, T != S)."""
    q, kv = _x(T=16), _x(T=37, seed=1)
    full = FullAttention(num_heads=2, key_dim=8)
    full(q, kv)
    overrides, tol = LinformerAttention(**KWARGS).full_attention_limit(37)
    limited = LinformerAttention(**dict(KWARGS, **overrides))
    limited(q, kv)
    limited.set_weights(full.get_weights())
    assert rel_error(to_np(limited(q, kv)), to_np(full(q, kv))) <= tol


def test_no_causal_mode_and_no_scores():
    layer = _built()
    x = _x()
    with pytest.raises(ValueError, match=r"no causal mode: each projected slot .*"
                                         r"use_causal_mask=True"):
        layer(x, x, use_causal_mask=True)
    with pytest.raises(ValueError, match="return_attention_scores"):
        layer(x, x, return_attention_scores=True)
    # What it offers instead (the docs' figure): every query draws on every
    # real key.
    mask = np.ones((2, 37), bool)
    mask[0, 30:] = False
    support = to_np(layer.attention_support(x, x, value_mask=mask))
    assert support.shape == (2, 2, 37, 37)
    np.testing.assert_array_equal(support, np.broadcast_to(mask[:, None, None, :], support.shape))


def test_longer_sequence_is_refused():
    layer = _built()
    x = _x(T=65)
    with pytest.raises(ValueError, match=r"65 positions.*key length 65 > max_length=64"):
        layer(x, x)
    # The query may be longer: only the keys are projected.
    assert tuple(layer(x, x[:, :64]).shape) == (2, 65, 16)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k": 0}, r"Received: k=0"),
        ({"k": 65}, r"max_length=64\)\. Received: k=65"),
        ({"k": 2.5}, r"Received: k=2.5"),
        ({"max_length": 0}, r"Received: max_length=0"),
        ({"sharing": "rows"}, r"Received: sharing='rows'"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LinformerAttention(**dict(KWARGS, **kwargs))


def test_projection_bad_arguments():
    with pytest.raises(ValueError, match=r"Received: k=9"):
        LinformerProjection(k=9, max_length=8)
    with pytest.raises(ValueError, match=r"Received: num_heads=0"):
        LinformerProjection(k=2, max_length=8, num_heads=0)


def test_defaults_config_and_multi_head_attention_weights():
    layer = LinformerAttention(num_heads=2, key_dim=8)
    config = layer.get_config()
    for key, value in (("k", 256), ("max_length", 512), ("sharing", "headwise"),
                       ("projection", None)):
        assert config[key] == value
    assert config["projection_initializer"]["config"]["stddev"] == pytest.approx(256 ** -0.5)
    assert LinformerAttention.from_config(config).get_config() == config
    x = _x()
    mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8)
    mha(x, x)
    ours = LinformerAttention.from_multi_head_attention(mha, k=8, max_length=64)
    for a, b in zip(ours.get_weights(), mha.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert len(ours.get_weights()) == 10


# ------------------------------------------------------- linear memory
@pytest.mark.skipif(BACKEND != "jax", reason="inspects the traced JAX program")
def test_projected_path_builds_no_quadratic_tensor():
    """No intermediate of the forward and backward "projected" path holds
    more than a few times n * k * H elements (an n x n tensor would hold
    n^2 * H)."""
    import jax

    n, H, d, k = 512, 2, 8, 16
    layer = LinformerAttention(num_heads=H, key_dim=d, k=k, max_length=n)
    x = _x(B=1, T=n)
    layer(x[:, :16], x[:, :16])
    q, key, v = layer._query_dense(x), layer._key_dense(x), layer._value_dense(x)
    from keras_longattn import ops as la_ops
    from keras_longattn.layers import AttentionContext

    context = AttentionContext(padding=la_ops.PaddingMask(None, None), causal=False,
                               query_length=n, key_length=n)

    def loss(q, key, v):
        return jax.numpy.sum(layer._projected.run(layer, q, key, v, context) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, key, v)
    largest = max(
        int(np.prod(var.aval.shape)) if var.aval.shape else 1
        for eqn in jaxpr.jaxpr.eqns
        for var in eqn.outvars
    )
    assert largest <= 4 * n * max(k, d) * H, largest
