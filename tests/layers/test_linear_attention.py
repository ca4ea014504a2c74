"""LinearAttention: the conformance suite, an independent NumPy loop of the
layer (causal and bidirectional, padding, cross-attention), chunk sizes,
zero ReLU features, float16 at n = 4096 with large activations, memory of
the causal path, no full-attention limit, bad input."""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import LinearAttention
from keras_longattn.ops import kernelized
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error
from keras_longattn.testing.gradients import input_gradient

BACKEND = keras.backend.backend()
KWARGS = {"num_heads": 2, "key_dim": 8, "chunk_size": 6}


@pytest.fixture(autouse=True)
def _seeded():
    keras.utils.set_random_seed(0)


# ---------------------------------------------------------- conformance
class TestLinearAttentionKernel(AttentionLayerConformance):
    """The paper's feature map elu + 1; chunks of 6 (37 is not a multiple)."""

    layer_cls = LinearAttention
    init_kwargs = KWARGS
    implementation = "kernel"
    reference_lengths = (5, 16, 37, 2048)

    def test_equals_full_attention_in_its_limit(self):
        """No feature map of the family gives softmax attention: the layer
        declares no limit, and is checked against its explicit quadratic
        form instead (both modes, at a length of several chunks)."""
        layer = self.make_layer()
        assert layer.full_attention_limit(64) is None
        x = self.make_inputs(100)
        for causal in (True, False):
            out = to_np(layer(x, x, use_causal_mask=causal))
            ref = self.reference_output(layer, x, x, use_causal_mask=causal)
            assert rel_error(out, ref) <= 1e-5


class TestLinearAttentionRelu(TestLinearAttentionKernel):
    layer_cls = LinearAttention
    init_kwargs = dict(KWARGS, feature_map="relu")
    secondary = True
    reference_lengths = (37,)


# ------------------------------------------------------------- helpers
def _x(B=2, T=37, F=16, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return (scale * rng.standard_normal((B, T, F))).astype("float32")


def _phi(x, name):
    if name == "relu":
        return np.maximum(x, 0.0)
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def numpy_linear(layer, query, value, causal=False, value_mask=None, eps=1e-6):
    """The layer in NumPy (float64), one example, head and query at a time:
    running sums over the visible real keys."""
    q = to_np(layer._query_dense(query)).astype("float64")
    k = to_np(layer._key_dense(value)).astype("float64")
    v = to_np(layer._value_dense(value)).astype("float64")
    B, T, H, _ = q.shape
    S = k.shape[1]
    keep = np.ones((B, S), bool) if value_mask is None else np.asarray(value_mask, bool)
    fq, fk = _phi(q, layer.feature_map), _phi(k, layer.feature_map)
    out = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            for i in range(T):
                seen = keep[b].copy()
                if causal:
                    seen[i + 1:] = False
                s = fk[b, seen, h]  # (visible, F)
                num = fq[b, i, h] @ (s.T @ v[b, seen, h])
                den = fq[b, i, h] @ s.sum(0)
                out[b, i, h] = num / max(den, eps)
    kernel, bias = (to_np(w).astype("float64") for w in layer._output_dense.weights)
    return np.einsum("bthd,hdo->bto", out, kernel) + bias


# ----------------------------------------------------------- definition
@pytest.mark.parametrize("feature_map", ["elu+1", "relu"])
@pytest.mark.parametrize("causal", [True, False])
def test_paths_equal_numpy_loop(feature_map, causal):
    """Both paths equal an independent NumPy loop, with right and left
    padding, self- and cross-attention (T < S and T > S)."""
    x = _x()
    mask = np.ones((2, 37), bool)
    mask[0, 30:] = False
    mask[1, :5] = False
    for T in (37, 23, 45):
        q = _x(T=T, seed=T)
        for impl in ("kernel", "reference"):
            layer = LinearAttention(**dict(KWARGS, feature_map=feature_map,
                                           implementation=impl))
            out = to_np(layer(q, x, value_mask=mask, use_causal_mask=causal))
            assert layer.last_implementation == impl
            expected = numpy_linear(layer, q, x, causal=causal, value_mask=mask)
            assert rel_error(out, expected) < 1e-5, (impl, T)


def test_chunk_size_does_not_change_the_result():
    """Chunks of 1, 7, 64 and longer than the sequence: one result."""
    x = _x(T=50)
    base = LinearAttention(**dict(KWARGS, chunk_size=1))
    expected = to_np(base(x, x, use_causal_mask=True))
    for chunk in (7, 64, 1000):
        layer = LinearAttention(**dict(KWARGS, chunk_size=chunk))
        layer(x, x)
        layer.set_weights(base.get_weights())
        out = to_np(layer(x, x, use_causal_mask=True))
        assert rel_error(out, expected) < 1e-5, chunk


# --------------------------------------------------------- zero features
def test_query_with_all_zero_relu_features():
    """A query with no positive coordinate (ReLU features all 0) gets a
    zero attention output (the output projection's bias) and finite
    gradients; the other queries are unchanged. Without the safe
    normaliser the division is 0 / 0."""
    layer = LinearAttention(num_heads=1, key_dim=4, feature_map="relu")
    x = _x(B=1, T=10, F=4)
    layer(x, x)
    weights = layer.get_weights()
    weights[0] = np.eye(4, dtype="float32")[:, None, :]  # query = input
    weights[1] = np.zeros_like(weights[1])
    layer.set_weights(weights)
    x[0, 3] = -np.abs(x[0, 3]) - 0.5  # query 3: every coordinate negative
    for causal in (True, False):
        out = to_np(layer(x, x, use_causal_mask=causal))
        bias = to_np(layer._output_dense.weights[1])
        np.testing.assert_allclose(out[0, 3], bias, atol=1e-6)
        expected = numpy_linear(layer, x, x, causal=causal)
        assert rel_error(out, expected) < 1e-5

        def f(inp, causal=causal):
            return layer(inp, inp, use_causal_mask=causal)

        g = input_gradient(f, x)
        assert np.all(np.isfinite(g))


# -------------------------------------------------------------- precision
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_long_input_with_large_activations_in_low_precision(policy, causal):
    """n = 4096 and activations of about 100 under a float16 policy: the
    sums are kept in float32, so the output is finite and close to the
    float32 layer on the same weights. The same sums in float16 overflow
    (the check below has teeth: the float16 key-value sum is inf)."""
    n = 4096
    x = _x(B=1, T=n, F=16, scale=30.0)
    full = LinearAttention(num_heads=2, key_dim=8)
    expected = to_np(full(x, x, use_causal_mask=causal))
    low = LinearAttention(num_heads=2, key_dim=8, dtype=policy)
    low.build(x.shape, x.shape)
    low.set_weights(full.get_weights())
    y = to_np(keras.ops.cast(low(x, x, use_causal_mask=causal), "float32"))
    assert np.all(np.isfinite(y))
    tol = 2e-2 if policy == "mixed_float16" else 1e-1
    assert rel_error(y, expected) < tol
    k = to_np(low._key_dense(x)).astype("float32")
    v = to_np(low._value_dense(x)).astype("float32")
    assert np.abs(k).max() > 50  # large activations indeed
    if policy == "mixed_float16":
        features = _phi(k[0, :, 0], "elu+1").astype("float16")
        with np.errstate(over="ignore"):
            naive = features.T @ v[0, :, 0].astype("float16")
        assert not np.all(np.isfinite(naive))


# ---------------------------------------------------------------- memory
@pytest.mark.skipif(BACKEND != "jax", reason="inspects the traced JAX program")
def test_causal_path_builds_no_per_position_state():
    """No intermediate of the causal forward and backward pass holds a
    (d, dv) running sum for every position: the largest is far below
    n * d * dv * H (what a per-position prefix sum would build)."""
    import jax

    n, H, d, C = 1024, 2, 16, 16
    q = jax.numpy.ones((1, n, H, d))

    def loss(q, k, v):
        out = kernelized.causal_kernel_attention(
            kernelized.feature_map(q, "elu+1"), kernelized.feature_map(k, "elu+1"),
            v, chunk_size=C,
        )
        return jax.numpy.sum(out ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q)
    largest = max(
        int(np.prod(var.aval.shape)) if var.aval.shape else 1
        for eqn in jaxpr.jaxpr.eqns
        for var in eqn.outvars
    )
    assert largest <= n * d * d * H // 8, largest


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"feature_map": "softmax"}, r"Received: feature_map='softmax'"),
        ({"feature_map": None}, r"Received: feature_map=None"),
        ({"chunk_size": 0}, r"Received: chunk_size=0"),
        ({"chunk_size": 2.5}, r"Received: chunk_size=2.5"),
        ({"epsilon": 0.0}, r"Received: epsilon=0.0"),
        ({"dropout": 0.1}, r"Received: dropout=0.1"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LinearAttention(**dict(KWARGS, **kwargs))


def test_config_defaults():
    config = LinearAttention(num_heads=2, key_dim=8).get_config()
    assert (config["feature_map"], config["chunk_size"], config["epsilon"]) == (
        "elu+1", 64, 1e-6)
    assert LinearAttention.from_config(config).get_config() == config


@pytest.mark.skipif(BACKEND != "torch", reason="the fused kernelized path exists on PyTorch only")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layer_name", ["linear", "performer"])
def test_fused_path_in_head_slices_equals_portable(layer_name, causal, monkeypatch):
    """The fused path runs a few heads at a time (ops.kernelized.head_slices): with one
    head per slice (a tiny element limit) and with all heads in one, its
    values and input gradients equal the portable path's, padding
    included."""
    from keras_longattn.layers import PerformerAttention
    from keras_longattn.ops import kernelized as la

    if layer_name == "linear":
        cls, kwargs, fused_name, portable = LinearAttention, dict(KWARGS, num_heads=3), \
            "kernel_fused", "kernel"
    else:
        cls, kwargs, fused_name, portable = PerformerAttention, dict(
            num_heads=3, key_dim=8, num_features=16, chunk_size=6, seed=3), \
            "favor_fused", "favor"
    rng = np.random.default_rng(5)
    x = (0.5 * rng.standard_normal((2, 29, 12))).astype("float32")
    mask = np.ones((2, 29), bool)
    mask[1, 20:] = False
    ref = cls(**dict(kwargs, implementation=portable))
    ref(x, x)

    def run(layer):
        fn = lambda v: layer(v, v, value_mask=mask, use_causal_mask=causal)  # noqa: E731
        return to_np(fn(x)), input_gradient(fn, x)

    expected = run(ref)
    for limit in (1, 10**9):
        monkeypatch.setattr(la, "MAX_SLICE_ELEMENTS", limit)
        x3 = np.zeros((2, 29, 3, 8), "float32")
        assert len(la.head_slices(x3, x3, 8)) == (3 if limit == 1 else 1)
        fused = cls(**dict(kwargs, implementation=fused_name))
        fused(x, x)
        fused.set_weights(ref.get_weights())
        got = run(fused)
        assert fused.last_implementation == fused_name
        for a, b in zip(got, expected):
            assert rel_error(a, b) < 1e-5, (limit, rel_error(a, b))
