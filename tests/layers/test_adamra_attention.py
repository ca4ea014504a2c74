"""AdaMRAAttention: the conformance suite for each implementation, an
independent NumPy loop of the whole layer, padding, the router's gradient,
random routing, zero ReLU features, the full-attention limit, linear
memory and bad input."""

import keras
import numpy as np
import pytest
from keras.ops import convert_to_numpy as to_np

from keras_longattn.layers import AdaMRAAttention
from keras_longattn.layers import FullAttention
from keras_longattn.ops import adamra as adamra_ops
from keras_longattn.testing import AttentionLayerConformance
from keras_longattn.testing import rel_error
from keras_longattn.testing.gradients import input_gradient
from keras_longattn.testing.gradients import weight_gradients

BACKEND = keras.backend.backend()


@pytest.fixture(autouse=True)
def _seeded():
    """Initial weights drawn from a fixed seed (a routing decision near a tie
    must not make a test flaky)."""
    keras.utils.set_random_seed(0)
KWARGS = {"num_heads": 2, "key_dim": 8, "compression_rates": (1 / 2, 1 / 3)}


# ---------------------------------------------------------- conformance
class TestAdaMRAKernel(AttentionLayerConformance):
    """The paper's layer: kernelized (ReLU) attention, learned routing, two
    subheads; rates 1/2 and 1/3 (1/3: segments that do not divide n)."""

    layer_cls = AdaMRAAttention
    init_kwargs = dict(KWARGS, num_subheads=2)
    implementation = "kernel"
    reference_lengths = (5, 37, 2048)
    # Property checks run in CI for this class: batch composition, unknown
    # lengths while tracing, non-finite padding (random lengths against the
    # reference: test_paths_equal_reference_and_numpy_loop, and --run-slow).
    ci_properties = ("test_prop_batch_composition", "test_prop_dynamic_length",
                     "test_prop_nonfinite_padding")


class TestAdaMRASoftmax(AttentionLayerConformance):
    """The "Softmax" ablation: a softmax over the landmarks, with dropout."""

    layer_cls = AdaMRAAttention
    init_kwargs = dict(KWARGS, attention="softmax")
    implementation = "softmax"
    secondary = True
    reference_lengths = (5, 37)


# ------------------------------------------------------------- helpers
def _x(B=2, T=37, F=16, seed=0):
    return np.random.default_rng(seed).standard_normal((B, T, F)).astype("float32")


def _clone(layer, **overrides):
    config = layer.get_config()
    config.update(overrides)
    other = AdaMRAAttention.from_config(config)
    other.build(layer._query_shape, layer._value_shape, layer._key_shape)
    other.set_weights(layer.get_weights())
    return other


def numpy_adamra(layer, query, value, query_mask=None, value_mask=None):
    """The layer in plain NumPy (float64), one example, head and query at
    a time: segment means of each example's real keys, kernel or softmax
    weights over the head's landmarks, the routing, the output projection."""
    q = to_np(layer._query_dense(query)).astype("float64")
    k = to_np(layer._key_dense(value)).astype("float64")
    v = to_np(layer._value_dense(value)).astype("float64")
    B, T, H, d = q.shape
    S = k.shape[1]
    dv = v.shape[-1]
    Sub = layer.num_subheads
    kmask = np.ones((B, S), bool) if value_mask is None else np.asarray(value_mask, bool)
    qmask = np.ones((B, T), bool) if query_mask is None else np.asarray(query_mask, bool)

    def phi(x):
        if layer.feature_map == "relu":
            return np.maximum(x, 0.0)
        return np.where(x > 0, x + 1.0, np.exp(x))

    if layer.routing == "learned":
        logits = q.reshape(B, T, H * d) @ to_np(layer._router.kernel).astype("float64")
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        route = np.zeros((B, T, H))
        choice = p.argmax(-1)
        for b in range(B):
            for t in range(T):
                route[b, t, choice[b, t]] = p[b, t, choice[b, t]]
    elif layer.routing == "random":
        ranks = np.maximum(np.cumsum(qmask, axis=1) - 1, 0)
        heads = to_np(adamra_ops.random_heads(ranks, H, layer.seed))
        route = np.eye(H)[heads]
    else:
        route = np.ones((B, T, H))
    out = np.zeros((B, T, H, dv))
    for b in range(B):
        real = np.flatnonzero(kmask[b])
        n = len(real)
        for h, rate in enumerate(layer.compression_rates):
            m = max(1, int(np.ceil(n * rate - 1e-9)))
            seg = max(1, -(-n // m))
            groups = [real[i : i + seg] for i in range(0, n, seg)]
            kl = np.array([k[b, g, h].mean(0) for g in groups]).reshape(-1, d)
            vl = np.array([v[b, g, h].mean(0) for g in groups]).reshape(-1, dv)
            for s in range(Sub):
                fk = slice(s * d // Sub, (s + 1) * d // Sub)
                fv = slice(s * dv // Sub, (s + 1) * dv // Sub)
                for t in range(T):
                    if layer.attention == "kernel":
                        w = phi(kl[:, fk]) @ phi(q[b, t, h, fk])
                        w = w / max(w.sum(), layer.epsilon)
                    else:
                        z = kl[:, fk] @ q[b, t, h, fk] / np.sqrt(d // Sub)
                        w = np.exp(z - z.max()) if len(z) else z
                        w = w / w.sum() if len(z) else w
                    out[b, t, h, fv] = w @ vl[:, fv] if len(w) else 0.0
    out = out * route[..., None]
    return to_np(layer._output_dense(out.astype("float32")))


# ------------------------------------------------ paths == reference == loop
CONFIGS = [
    {"num_subheads": 2},
    {"feature_map": "elu+1", "routing": "random", "seed": 3},
    {"attention": "softmax", "routing": "all"},
    {"attention": "softmax", "num_subheads": 2, "compression_rates": (1.0, 1 / 8)},
    {"routing": "all", "compression_rates": (1 / 8, 1 / 32)},
]


@pytest.mark.parametrize("kwargs", CONFIGS, ids=lambda k: "-".join(f"{a}" for a in k.values()))
def test_paths_equal_reference_and_numpy_loop(kwargs):
    """Cross-attention (T != S), right and left padding: the efficient path,
    the reference and a NumPy loop agree on real queries."""
    q, kv = _x(T=37), _x(T=41, seed=1)
    qmask = np.ones((2, 37), bool)
    qmask[1, :4] = False
    kmask = np.ones((2, 41), bool)
    kmask[0, 30:] = False
    kmask[1, :7] = False
    layer = AdaMRAAttention(**dict(KWARGS, **kwargs))
    out = to_np(layer(q, kv, query_mask=qmask, value_mask=kmask))
    assert layer.last_implementation == layer.attention
    ref = _clone(layer, implementation="reference")
    expected = to_np(ref(q, kv, query_mask=qmask, value_mask=kmask))
    assert ref.last_implementation == "reference"
    loop = numpy_adamra(layer, q, kv, query_mask=qmask, value_mask=kmask)
    assert rel_error(out[qmask], expected[qmask]) < 1e-5
    assert rel_error(out[qmask], loop[qmask]) < 1e-5


def test_each_query_uses_one_head():
    """Learned routing: before the output projection, exactly one head of a
    query is non-zero, scaled by its router probability (below 1)."""
    layer = AdaMRAAttention(**KWARGS)
    x = _x()
    layer(x, x)
    q = layer._query_dense(x)
    heads = to_np(layer._kernel.run(layer, q, layer._key_dense(x), layer._value_dense(x),
                                    _context(x)))
    # At most one head (a routed head whose ReLU features are all zero
    # gives 0).
    nonzero = np.abs(heads).sum(-1) > 0
    assert np.all(nonzero.sum(-1) <= 1) and nonzero.sum() > 0.9 * nonzero.shape[0] * nonzero.shape[1]
    weights = to_np(layer.routing_weights(q))
    assert np.all((weights > 0).sum(-1) == 1)
    assert np.all(weights.max(-1) < 1.0) and np.all(weights.max(-1) >= 1.0 / 2)


def _context(x, key_mask=None, query_mask=None):
    from keras_longattn import ops as la_ops
    from keras_longattn.layers import AttentionContext

    return AttentionContext(
        padding=la_ops.PaddingMask(query_mask, key_mask), causal=False,
        query_length=x.shape[1], key_length=x.shape[1],
    )


# -------------------------------------------------------------- padding
def test_padded_positions_do_not_matter_and_batch_composition():
    """Perturbing padded keys changes nothing; an example alone equals the
    same example left-padded in a longer batch (its segments are cut from
    its own real keys)."""
    layer = AdaMRAAttention(**dict(KWARGS, num_subheads=2))
    n, N = 26, 37
    x = _x(T=N)
    mask = np.zeros((2, N), bool)
    mask[0, N - n :] = True  # left padding
    mask[1, :30] = True
    y = to_np(layer(x, x, query_mask=mask, value_mask=mask))
    x2 = np.where(mask[..., None], x, 1e3 * _x(T=N, seed=5)).astype("float32")
    y2 = to_np(layer(x2, x2, query_mask=mask, value_mask=mask))
    np.testing.assert_allclose(y2[mask], y[mask], rtol=1e-5, atol=1e-5)
    alone = to_np(layer(x[:1, N - n :], x[:1, N - n :]))
    assert rel_error(y[0, N - n :], alone[0]) < 1e-5


def test_landmarks_are_segment_means_of_real_keys():
    """m_h = ceil(n * c_h) landmarks of ceil(n / m_h) real keys each; for
    n = 37 and c = 1/3: 13 landmarks of 3 keys, the last holding 1."""
    layer = AdaMRAAttention(**KWARGS)
    x = _x(T=41)
    mask = np.ones((2, 41), bool)
    mask[0, 37:] = False
    layer(x, x)
    k, v = layer._key_dense(x), layer._value_dense(x)
    kl, _, counts = layer.landmarks(k, v, mask)
    kl, counts, k = to_np(kl), to_np(counts), to_np(k)
    assert kl.shape == (2, 21, 2, 8)  # M = ceil(41 / 2)
    np.testing.assert_array_equal(counts[0, :, 1], [3] * 12 + [1] + [0] * 8)
    np.testing.assert_array_equal(counts[0, :, 0], [2] * 18 + [1, 0, 0])
    np.testing.assert_allclose(kl[0, 12, 1], k[0, 36, 1], rtol=1e-6)
    np.testing.assert_allclose(kl[0, 0, 1], k[0, :3, 1].mean(0), rtol=1e-5)
    assert np.all(kl[0, 13:, 1] == 0)


# ------------------------------------------------------------- router
def _router_gradient(layer, x):
    layer(x, x)
    grads = weight_gradients(layer, lambda: keras.ops.sum(layer(x, x) ** 2))
    names = [v.path for v in layer.trainable_variables]
    (g,) = [g for name, g in zip(names, grads) if "router" in name]
    return np.zeros(1) if g is None else g


class _UnscaledAdaMRA(AdaMRAAttention):
    """The planted bug: the routed head's output is not multiplied by its
    router probability."""

    _scale_by_router_probability = False


@pytest.mark.parametrize("attention", ["kernel", "softmax"])
def test_router_learns_only_through_the_probability(attention):
    x = _x()
    g = _router_gradient(AdaMRAAttention(**KWARGS, attention=attention), x)
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 1e-6
    planted = _router_gradient(_UnscaledAdaMRA(**KWARGS, attention=attention), x)
    assert np.abs(planted).max() == 0.0


def test_router_weight_name_and_weight_order():
    layer = AdaMRAAttention(**KWARGS)
    x = _x()
    layer(x, x)
    names = [w.path.split("/", 1)[1] for w in layer.weights]
    assert names[-1] == "router/kernel"
    assert tuple(layer.weights[-1].shape) == (2 * 8, 2)
    for routing in ("random", "all"):
        other = AdaMRAAttention(**KWARGS, routing=routing)
        other(x, x)
        assert len(other.weights) == len(layer.weights) - 1


def test_random_routing_is_seeded_and_deterministic():
    """Fixed pseudo-random heads per position: the same in every call and
    on every backend (stored values), about uniform, changed by the seed,
    independent of the query padding's position."""
    ranks = np.arange(4096, dtype="int32")[None]
    heads = to_np(adamra_ops.random_heads(ranks, 4, seed=0))[0]
    np.testing.assert_array_equal(heads[:12], RANDOM_HEADS_SEED0)
    counts = np.bincount(heads, minlength=4) / 4096
    assert np.all(np.abs(counts - 0.25) < 0.03), counts
    again = to_np(adamra_ops.random_heads(ranks, 4, seed=0))[0]
    np.testing.assert_array_equal(heads, again)
    other = to_np(adamra_ops.random_heads(ranks, 4, seed=1))[0]
    assert np.mean(other != heads) > 0.5
    layer = AdaMRAAttention(**KWARGS, routing="random", seed=7)
    x = _x()
    y1, y2 = to_np(layer(x, x)), to_np(layer(x, x))
    np.testing.assert_array_equal(y1, y2)
    w = to_np(layer.routing_weights(layer._query_dense(x)))
    assert np.all(w.sum(-1) == 1) and set(np.unique(w)) <= {0.0, 1.0}
    mask = np.ones((2, 37), bool)
    mask[:, :3] = False
    shifted = to_np(layer.routing_weights(layer._query_dense(x), mask))
    np.testing.assert_array_equal(shifted[:, 3:], w[:, :34])


#: The first heads of routing="random" with seed 0 and 4 heads (the same on
#: every backend).
RANDOM_HEADS_SEED0 = [3, 0, 1, 1, 3, 3, 1, 3, 3, 0, 3, 2]


# ------------------------------------------------------- zero features
def test_zero_relu_features_give_the_stated_output():
    """Queries with no positive coordinate have all-zero ReLU features and
    a zero normaliser: their attention output is exactly 0, so the layer's
    output is the output projection's bias, finite, with finite gradients."""
    layer = AdaMRAAttention(**dict(KWARGS, num_subheads=2))
    x = _x()
    layer(x, x)
    weights = layer.get_weights()
    weights[0] = np.zeros_like(weights[0])  # query kernel
    weights[1] = -np.ones_like(weights[1])  # query bias: q = -1
    weights[7] = np.linspace(-1, 1, weights[7].size).astype("float32")  # output bias
    layer.set_weights(weights)
    for impl in ("kernel", "reference"):
        other = _clone(layer, implementation=impl)
        y = to_np(other(x, x))
        np.testing.assert_array_equal(y, np.broadcast_to(weights[7], y.shape))
    g = input_gradient(lambda v: layer(v, v), x)
    assert np.all(np.isfinite(g))
    grads = weight_gradients(layer, lambda: keras.ops.sum(layer(x, x)))
    assert all(gr is None or np.all(np.isfinite(gr)) for gr in grads)


# ---------------------------------------------------- full-attention limit
def test_limit_equals_full_attention_with_padding():
    """Rate 1, a softmax, one subhead, every head: FullAttention on the same
    weights (1e-5), with padding and an odd length."""
    x = _x()
    mask = np.ones((2, 37), bool)
    mask[0, 20:] = False
    full = FullAttention(num_heads=2, key_dim=8)
    full(x, x)
    layer = AdaMRAAttention(**KWARGS)
    overrides, tol = layer.full_attention_limit(37)
    limited = AdaMRAAttention(**dict(KWARGS, **overrides))
    limited(x, x)
    limited.set_weights(full.get_weights())
    ours = to_np(limited(x, x, query_mask=mask, value_mask=mask))
    theirs = to_np(full(x, x, query_mask=mask, value_mask=mask))
    assert rel_error(ours[mask], theirs[mask]) <= tol
    # Learned routing is not full attention: one head per query, scaled.
    routed = AdaMRAAttention(**dict(KWARGS, **dict(overrides, routing="learned")))
    routed(x, x)
    routed.set_weights(full.get_weights())
    assert rel_error(to_np(routed(x, x)), to_np(full(x, x))) > 1e-2


# ------------------------------------------------------------ contract
def test_no_causal_mode_and_no_dense_mask():
    layer = AdaMRAAttention(**KWARGS)
    x = _x()
    with pytest.raises(ValueError, match="no causal mode"):
        layer(x, x, use_causal_mask=True)
    with pytest.raises(ValueError, match="return_attention_scores"):
        layer(x, x, return_attention_scores=True)
    dense = np.ones((2, 37, 37), bool)
    with pytest.raises(ValueError, match="attention_mask"):
        layer(x, x, attention_mask=dense)


def test_reference_dense_mask_cuts_landmarks_per_query():
    """The reference honours a dense mask: each query's landmarks come from
    the keys it may see; an all-True mask changes nothing, and a mask equal
    to the key padding for every query equals that padding."""
    layer = AdaMRAAttention(**KWARGS, implementation="reference")
    x = _x()
    y = to_np(layer(x, x))
    ones = np.ones((2, 37, 37), bool)
    np.testing.assert_allclose(to_np(layer(x, x, attention_mask=ones)), y, rtol=1e-5, atol=1e-6)
    kmask = np.ones((2, 37), bool)
    kmask[1, 25:] = False
    padded = to_np(layer(x, x, value_mask=kmask))
    dense = np.broadcast_to(kmask[:, None, :], (2, 37, 37))
    np.testing.assert_allclose(to_np(layer(x, x, attention_mask=dense)), padded,
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"compression_rates": (0.5, 2.0)}, r"compression_rates=\(0.5, 2.0\)"),
        ({"compression_rates": (0.5, 0.0)}, r"compression_rates=\(0.5, 0.0\)"),
        ({"compression_rates": (0.5,)}, r"one rate per head .*compression_rates=\(0.5,\)"),
        ({"compression_rates": "0.5"}, r"compression_rates='0.5'"),
        ({"num_subheads": 3}, r"num_subheads=3"),
        ({"num_subheads": 0}, r"num_subheads=0"),
        ({"feature_map": "softplus"}, r"feature_map='softplus'"),
        ({"routing": "top2"}, r"routing='top2'"),
        ({"attention": "linear"}, r"attention='linear'"),
        ({"epsilon": 0.0}, r"epsilon=0.0"),
        ({"dropout": 0.1}, r"dropout=0.1 with attention='kernel'"),
        ({"implementation": "fused"}, r"implementation='fused'"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AdaMRAAttention(**dict(KWARGS, **kwargs))


def test_value_dim_must_split_into_subheads():
    with pytest.raises(ValueError, match=r"value_dim=6.*num_subheads=4"):
        AdaMRAAttention(num_heads=2, key_dim=8, value_dim=6, num_subheads=4,
                        compression_rates=(0.5, 0.25))


def test_defaults_and_config():
    layer = AdaMRAAttention(num_heads=4, key_dim=8)
    assert layer.compression_rates == (1 / 2, 1 / 4, 1 / 8, 1 / 16)
    config = layer.get_config()
    for key, value in (("num_subheads", 1), ("feature_map", "relu"), ("routing", "learned"),
                       ("attention", "kernel"), ("epsilon", 1e-6)):
        assert config[key] == value
    clone = AdaMRAAttention.from_config(config)
    assert clone.get_config() == config


def test_mixed_precision_long_sequence_is_finite():
    """float16 compute with sums over many landmarks (accumulated in
    float32): finite and close to float32 (fixed random routes: a learned
    route near a tie may flip in float16)."""
    x = _x(B=1, T=1024)
    full = AdaMRAAttention(**KWARGS, routing="random")
    y = to_np(full(x, x))
    low = AdaMRAAttention(**KWARGS, routing="random", dtype="mixed_float16")
    low(x, x)
    low.set_weights(full.get_weights())
    y16 = to_np(keras.ops.cast(low(x, x), "float32"))
    assert np.all(np.isfinite(y16))
    assert rel_error(y16, y) < 2e-2


# ------------------------------------------------------- linear memory
@pytest.mark.skipif(BACKEND != "jax", reason="inspects the traced JAX program")
@pytest.mark.parametrize("attention", ["kernel"])
def test_kernel_path_builds_no_quadratic_tensor(attention):
    """No intermediate of the forward and backward kernel path holds more
    than a few times n * H * d elements (an n x m_h tensor would hold
    n^2 / 2 * H at rate 1/2)."""
    import jax

    n, H, d = 256, 4, 16
    layer = AdaMRAAttention(num_heads=H, key_dim=d, attention=attention)
    x = _x(B=1, T=n, F=H * d)
    layer(x[:, :16], x[:, :16])
    q = layer._query_dense(x)
    k, v = layer._key_dense(x), layer._value_dense(x)

    def loss(q, k, v):
        return jax.numpy.sum(layer._kernel.run(layer, q, k, v, _context(x)) ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    largest = 0

    def visit(jpr):
        nonlocal largest
        for eqn in jpr.eqns:
            for var in eqn.outvars:
                shape = getattr(var.aval, "shape", ())
                largest = max(largest, int(np.prod(shape)) if shape else 1)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    visit(inner)

    visit(jaxpr.jaxpr)
    assert largest <= 4 * n * H * d, largest


# ------------------------------------------------------- inspection, docs
def test_attention_support_marks_the_routed_head():
    layer = AdaMRAAttention(**KWARGS)
    x = _x()
    mask = np.ones((2, 37), bool)
    mask[0, 30:] = False
    layer(x, x)
    support = to_np(layer.attention_support(x, x, value_mask=mask))
    assert support.shape == (2, 2, 37, 37)
    rows = support.any(-1)  # (B, H, T)
    np.testing.assert_array_equal(rows.sum(1), 1)  # one head per query
    assert not support[0, :, :, 30:].any()
    np.testing.assert_array_equal(support[0].any(0), np.broadcast_to(mask[0], (37, 37)))


def test_docstring_examples():
    import doctest

    from keras_longattn.layers import adamra_attention

    result = doctest.testmod(adamra_attention, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
